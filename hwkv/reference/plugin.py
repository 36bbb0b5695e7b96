"""Built-in plugin: registers the CPU reference backend and the built-in KV connectors through the
same hooks as vendor plugins."""

from hwkv.interfaces.backend import API_VERSION, BackendSpec
from hwkv.plugins import hookimpl
from hwkv.plugins.hookspecs import ConnectorSpec


@hookimpl
def hwkv_backends() -> list[BackendSpec]:
    return [
        BackendSpec(
            name="cpu",
            api_version=API_VERSION,
            factory="hwkv.reference.backend:CpuBackend",
            description="CPU reference backend (pure torch): the numerical oracle of conformance",
        )
    ]


@hookimpl
def hwkv_connectors() -> list[ConnectorSpec]:
    return [
        ConnectorSpec(name="noop", api_version=API_VERSION, factory="hwkv.connectors.base:NoOpConnector",
                      description="does nothing (the same as no connector)"),
        ConnectorSpec(name="offload", api_version=API_VERSION, factory="hwkv.connectors.offload:OffloadConnector",
                      description="CPU offload: a host-memory tier of KV blocks (LRU, keyed by the prefix-cache "
                                  "block hashes) that device prefix-cache misses load from",
                      config=OFFLOAD_CONFIG),
    ]


OFFLOAD_CONFIG = {
    "cpu_bytes": "int, required: host memory for the tier, in bytes (whole KV blocks of all layers)",
    "min_run_blocks": "int, default 4: block runs at least this long (both sides consecutive) are copied "
                      "run by run with the runtime's memcpy; shorter ones go through Device.copy_blocks",
    "store": "bool, default True: store newly full device blocks into the tier (False: load-only)",
    "async_load": "bool, default False: load in the background while the request waits (False: the load "
                  "runs in the step that computes the rest of the prompt, which waits for it on the device)",
    "store_batch_blocks": "int, default 16: newly full blocks are stored once this many wait (fewer, larger "
                          "copies; a finishing request's are stored at once)",
    "load_timeout_s": "float, default None: an async load still running after this is reported failed and "
                      "its tokens are recomputed",
}

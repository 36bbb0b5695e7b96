"""Built-in plugin: registers the CPU reference backend through the same hook as vendor plugins
(the built-in KV connectors register through :mod:`hwkv.connectors.plugin`)."""

from hwkv.interfaces.backend import API_VERSION, BackendSpec
from hwkv.plugins import hookimpl


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

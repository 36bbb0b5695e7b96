"""Built-in plugin of the KV connectors: registers ``noop``, ``offload``, ``p2p`` and ``pool`` through
the ``hwkv_connectors`` hook, as a third-party connector package would (the plugin manager loads it
first, so a built-in name cannot be taken). It imports no connector: their classes are imported
by name when an engine builds one."""

from hwkv.interfaces.backend import API_VERSION
from hwkv.plugins import hookimpl
from hwkv.plugins.hookspecs import ConnectorSpec


@hookimpl
def hwkv_connectors() -> list[ConnectorSpec]:
    return [
        ConnectorSpec(name="noop", api_version=API_VERSION, factory="hwkv.connectors.base:NoOpConnector",
                      description="does nothing (the same as no connector)"),
        ConnectorSpec(name="offload", api_version=API_VERSION, factory="hwkv.connectors.offload:OffloadConnector",
                      description="CPU offload: a host-memory tier of KV blocks (LRU, keyed by the prefix-cache "
                                  "block hashes) that device prefix-cache misses load from",
                      config=OFFLOAD_CONFIG),
        ConnectorSpec(name="p2p", api_version=API_VERSION, factory="hwkv.connectors.p2p:P2PConnector",
                      description="prefill/decode disaggregation: the prompt's KV moves from a prefill engine "
                                  "(producer) to a decode engine (consumer) over Mooncake TransferEngine, "
                                  "pulled by the consumer or pushed by the producer",
                      config=P2P_CONFIG),
        ConnectorSpec(name="pool", api_version=API_VERSION, factory="hwkv.connectors.pool:PoolConnector",
                      description="global KV pool: prefix KV shared across engine instances through a Store "
                                  "(embedded in-process, or Mooncake across hosts)",
                      config=POOL_CONFIG),
    ]


OFFLOAD_CONFIG = {
    "cpu_bytes": "int, required: host memory for the tier, in bytes (whole KV blocks of all layers)",
    "min_run_blocks": "int or None, default None (automatic: 4 blocks host to host, 2 MiB per tensor across "
                      "a host link): block runs at least this long (both sides consecutive) are copied run by "
                      "run with the runtime's memcpy; shorter ones go through Device.copy_blocks",
    "store": "bool, default True: store newly full device blocks into the tier (False: load-only)",
    "async_load": "bool, default False: load in the background while the request waits (False: the load "
                  "runs in the step that computes the rest of the prompt, which waits for it on the device)",
    "store_batch_blocks": "int, default 32: newly full blocks are stored once this many wait (fewer, larger "
                          "copies; a finishing request's are stored at once)",
    "load_timeout_s": "float, default None: an async load still running after this is reported failed and "
                      "its tokens are recomputed",
    "layerwise_load": "bool, default True: a synchronous load is copied layer by layer and each layer's "
                      "attention waits only for its own layer, so the forward runs behind the copy (where the "
                      "device's graphs can wait on events, or it captures none, and the KV layout is not "
                      "cross-layer; else the forward waits for the whole load)",
}

P2P_CONFIG = {
    "role": "str, required: 'producer' (prefill engine) or 'consumer' (decode engine)",
    "mode": "str, default 'pull': 'pull' (the consumer READs the producer's held blocks) or 'push' (the "
            "producer WRITEs into blocks the consumer allocated); both sides must agree",
    "host": "str, default '127.0.0.1': address of the side channel and the transfer endpoint",
    "side_channel_port": "int, default 0: ZMQ side-channel port (0: any free one; it travels in kv_transfer_params)",
    "protocol": "str, default 'auto': Mooncake transport ('tcp', 'rdma', 'ascend'); auto: the backend's first "
                "declared one, else tcp for a host KV cache",
    "staging": "bool, default None: move KV through a pinned host mirror of the pool (None: when tcp meets a "
               "device KV cache, the only way tcp reaches GPU memory)",
    "metadata_server": "str, default 'P2PHANDSHAKE': Mooncake metadata (P2PHANDSHAKE needs no service)",
    "device_name": "str, default '': RDMA devices for protocol 'rdma' (empty: auto)",
    "transfer_timeout_s": "float, default 10: bound of every side-channel call and transfer; a load not done "
                          "within 3x this recomputes",
    "hold_timeout_s": "float, default 60: the producer frees a prefilled request's blocks no consumer "
                      "fetched within this",
    "layerwise": "bool, default False: producer in push mode: write each layer's KV right after its forward wrote "
                 "it, when the consumer announced its blocks first (transfer_id); else one write at the end",
    "part_tokens": "int, default 1024: a load is copied in up to four token-ordered parts of at least this many "
                   "tokens (a failed part keeps the parts before it; each part is one more transfer call)",
}

POOL_CONFIG = {
    "store": "'embedded' (default: in-process, shared by the engines of one process) | 'mooncake' | a Store",
    "chunk_size": "int, default the block size: tokens per pool entry (a multiple of the block size)",
    "model_id": "str, default '<model dir name>-<fingerprint of config and weights>': the model part of keys",
    "tp_rank": "int, default 0: tensor-parallel rank of this engine's KV shard (part of keys)",
    "tp_size": "int, default 1: tensor-parallel size (part of keys)",
    "pp_rank": "int, default 0: pipeline stage (part of keys)",
    "lookup_timeout_s": "float, default 1.0: a lookup without an answer by then is a miss",
    "load_timeout_s": "float, default 10.0: a load still running by then fails (the request recomputes)",
    "retry_s": "float, default 2.0: after a store failure, lookups miss and puts drop this long, then retry",
    "lookup_address": "str, default an IPC socket in a private temp dir: the lookup server's ZMQ address",
    "staging_bytes": "int, default 64 MiB: host staging per thread when the KV cache is not host memory",
    "load_parallel": "int 1..32, default 4: concurrent get calls per load, each on a share of its chunks (a "
                     "holder serves one call per thread: `hwkv pool master --holder-threads`); pieces of a "
                     "multiple of it fill the staging, so staging_bytes should hold 2 x load_parallel chunks; "
                     "with several `holders` a load reads each holder through its own client, one call each",
    "load_clients": "int 1..32, default 1: store clients a load's chunks are spread over (contiguous shares, "
                    "at once); holder mode: one shared memory and holder connection each; every extra client "
                    "has a get staging of staging_bytes / load_clients",
    "save": "bool, default True: put newly computed chunks (False: load-only)",
    "pack": "bool, default False: with one block per chunk and host staging, a load gets each value as one "
            "segment and scatters it into the blocks on the device (else one segment per KV tensor)",
    "store_name": "embedded: str, default 'default': engines of one process naming the same store share it",
    "capacity_bytes": "embedded: int, default 1 GiB: the store's capacity (LRU eviction)",
    "master": "mooncake: 'host:port' of mooncake_master's RPC port (required; `hwkv pool master` starts one)",
    "metadata_server": "mooncake: default 'P2PHANDSHAKE', or the master's HTTP metadata URL",
    "protocol": "mooncake: 'tcp' (default) or 'rdma'",
    "host": "mooncake: default '127.0.0.1': this client's address as other clients reach it",
    "global_segment_size": "mooncake: int, default 256 MiB: memory this client contributes to the pool "
                           "(0 with `hwkv pool master`'s holders: the pool then outlives this engine)",
    "replicas": "mooncake: int, default 1: copies of each value, on different holders' segments",
    "holder": "mooncake: 'host:port' of a holder (mooncake_client) on this host: values move through shared "
              "memory with it instead of tcp (`hwkv pool master --holder-port`)",
    "holders": "mooncake: several holders on this host, {'host:port' to attach at: 'host:port' of its segment} "
               "(`hwkv pool master --holders N` prints it): puts go through the first, the master spreads the "
               "values over all; a load reads each value through a client of the holder that has it (all at "
               "once; load_clients clients per holder). Instead of holder",
    "shm_bytes": "mooncake with holder: int, default 2 x staging_bytes + 64 MiB: the shared memory",
    "local_buffer_size": "mooncake: int, default 0",
    "device_name": "mooncake: rdma device names ('' = auto)",
    "timeout_s": "mooncake: float, default 5.0: bound of every store call",
    "connect_timeout_s": "mooncake: float, default 3.0: bound of reaching the master",
}

"""Global KV pool connector (``pool``): prefix KV shared across engine instances through a Store
(the design of vllm-ascend's AscendStore / Mooncake store connector; docs/connectors.md maps it).

The unit is a *chunk* of ``chunk_size`` tokens (a multiple of the block size, default one block),
keyed by :class:`~hwkv.connectors.pool.key.PoolKey` (model identity, KV layout and dtype, shard,
the prefix-cache chain hash of the chunk's last block).

Two sides, each owning its state: :class:`~hwkv.connectors.pool.scheduler.PoolScheduler` (lookups
through the lookup bridge, offers, load and store jobs, pins of device blocks) and
:class:`~hwkv.connectors.pool.worker.PoolWorker`; they share the chunk geometry
(:class:`~hwkv.connectors.pool.scheduler.PoolGeometry`) and talk through the per-step metadata, the
completions and the lookup bridge only.

Worker side (:mod:`hwkv.connectors.pool.worker`): owns the store client
(:class:`~hwkv.connectors.pool.store.StoreHandle`), the lookup server and the sending/receiving
threads (:mod:`hwkv.connectors.pool.transfer`). ``delay_free`` is never needed: a put reads pinned
blocks, and the pool keeps its own copy.

Failures (the pool is a cache): a store that is unreachable, fails or times out makes lookups
miss and puts drop for ``retry_s``, then it is tried again; a load that fails (key evicted since the
lookup, store down, timeout) or runs past ``load_timeout_s`` is reported in ``failed_recving`` and
the request recomputes — identical tokens, ``load_failures`` counted.

Tensor parallelism: every rank puts and gets its own shard under its own keys (``PoolKey`` carries
``tp<rank>/<size>``, so shards of different splits never mix); the lookup (rank 0's) counts a chunk
only where every rank's key is present; a load is done once every rank's get is.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import Any

from hwkv.connectors.base.jobs import Meta
from hwkv.connectors.base.roles import SplitConnector
from hwkv.connectors.pool.key import PoolKey, default_model_id
from hwkv.connectors.pool.lookup import LookupClient
from hwkv.connectors.pool.scheduler import PoolGeometry, PoolScheduler
from hwkv.connectors.pool.store import StoreHandle, owns_memory, store_factory
from hwkv.connectors.pool.worker import PoolWorker


def _positive(name: str, v: Any, integer: bool = False) -> None:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or v <= 0:
        raise ValueError(f"pool: {name}={v!r} is invalid (need a positive {'int' if integer else 'number'})")


class PoolConnector(SplitConnector):
    """``kv_connector="pool"``: the configuration, the store handle (the worker side's) and the two sides."""

    name = "pool"
    supports_tensor_parallel = True  # every rank gets and puts its own shard; the metadata is plain data
    supports_kv_groups = True  # each group's chunks under its own keys (docs/hybrid-models.md)
    metadata_type = Meta | None
    tp_job_keys = (PoolScheduler.extra_key,)
    scheduler: PoolScheduler
    worker: PoolWorker

    def __init__(self, store: Any = "embedded", chunk_size: int | None = None, model_id: str | None = None,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, lookup_timeout_s: float = 1.0,
                 load_timeout_s: float = 10.0, retry_s: float = 2.0, lookup_address: str | None = None,
                 staging_bytes: int = 64 << 20, save: bool = True, pack: bool = False, load_parallel: int = 4,
                 load_clients: int = 1, **store_options: Any):
        if chunk_size is not None:
            _positive("chunk_size", chunk_size, integer=True)
        for name, v in (("lookup_timeout_s", lookup_timeout_s), ("load_timeout_s", load_timeout_s),
                        ("retry_s", retry_s)):
            _positive(name, v)
        _positive("staging_bytes", staging_bytes, integer=True)
        if isinstance(load_parallel, bool) or not isinstance(load_parallel, int) or not 1 <= load_parallel <= 32:
            raise ValueError(f"pool: load_parallel={load_parallel!r} is invalid (need an int in 1..32: concurrent "
                             "get calls per load)")
        if isinstance(load_clients, bool) or not isinstance(load_clients, int) or not 1 <= load_clients <= 32:
            raise ValueError(f"pool: load_clients={load_clients!r} is invalid (need an int in 1..32: store clients "
                             "a load's chunks are spread over)")
        if not isinstance(pack, bool):
            raise ValueError(f"pool: pack={pack!r} is invalid (need true or false)")
        if model_id is not None and (not isinstance(model_id, str) or not model_id or "@" in model_id):
            raise ValueError(f"pool: model_id={model_id!r} is invalid (need a non-empty str without '@')")
        holders = _holders(store, store_options)  # [(client address, segment)] of several holders, or None
        if holders:
            store_options["holder"] = holders[0][0]  # puts go through the first; the master spreads the values
        if store == "mooncake" and store_options.get("holder") is not None:
            store_options.setdefault("shm_bytes", 2 * staging_bytes + (64 << 20))  # put + get staging, and slack
        factory, owned = store_factory(store, store_options)
        self.handle = StoreHandle(factory, owned, float(retry_s), owns_memory(store, store_options))
        # load clients: load_clients per holder (the main client is the first holder's first)
        attach = [h for h, _ in holders for _ in range(load_clients)][1:] if holders else \
            [store_options.get("holder")] * (load_clients - 1)
        clients = len(attach) + 1
        lanes = []
        for h in attach:
            lane_options = store_options
            if store == "mooncake" and h is not None:  # a load client's get staging only
                lane_options = {**store_options, "holder": h, "shm_bytes": staging_bytes // clients + (128 << 20)}
            lanes.append(StoreHandle(store_factory(store, lane_options)[0], owned, float(retry_s),
                                     owns_memory(store, lane_options)))
        segments = locator = None
        if holders:
            segments = [s for _, s in holders for _ in range(load_clients)]
            plain = {k: v for k, v in store_options.items() if k not in ("holder", "shm_bytes")}
            plain["global_segment_size"] = 0  # asks the master only; holds nothing
            locator = StoreHandle(store_factory(store, plain)[0], owned, float(retry_s))
        self.store_kind = store if isinstance(store, str) else type(store).__name__
        self.chunk_size, self.model_id = chunk_size, model_id
        self.shard = (tp_rank, tp_size, pp_rank)
        self.lookup_timeout_s, self.load_timeout_s = float(lookup_timeout_s), float(load_timeout_s)
        self.lookup_address, self.staging_bytes, self.save = lookup_address, staging_bytes, bool(save)
        self.scheduler = PoolScheduler(self.save)
        self.worker = PoolWorker(self.handle, self.load_timeout_s, staging_bytes, lookup_address, pack,
                                 load_parallel, lanes, segments, locator)
        # A connector never shut down still flushes its queued puts (bounded) and closes its store
        # client, when it is collected or at the latest at interpreter exit (before the teardown): a
        # Mooncake client left to the wheel's destructors aborts the process (std::terminate).
        weakref.finalize(self, _shutdown_sides, self.scheduler, self.worker)

    # ---- set-up --------------------------------------------------------------------------------
    def bind_model(self, model: str, model_config: Any = None) -> None:
        if self.model_id is None:
            self.model_id = default_model_id(model)

    def bind_tp(self, rank: int, size: int) -> None:
        super().bind_tp(rank, size)
        self.shard = (rank, size, self.shard[2])  # this rank's keys carry its shard

    def register_kv_caches(self, kv_cache: Any) -> None:
        spec = kv_cache.spec
        bs = spec.block_size
        chunk = self.chunk_size or bs
        if chunk % bs:
            raise ValueError(f"pool: chunk_size={chunk} is not a multiple of the block size {bs} "
                             f"(allowed: {bs}, {2 * bs}, ...)")
        if self.model_id is None:
            raise ValueError("pool: the model identity is unknown (the engine binds it; set model_id= when "
                             "the connector is used outside an Engine)")
        tp_rank, tp_size, pp_rank = self.shard
        chunk_blocks = chunk // bs
        groups = getattr(kv_cache, "groups", None)  # hwkv.engine.kv_groups.GroupedKVCache: a key per group
        geometry = PoolGeometry(bs, chunk_blocks, chunk_blocks * spec.bytes_per_block * self.tp_size,  # every shard's
                                tuple(len(g.layers) for g in groups) if groups else ())
        # the dtype part is the cache's format key: an fp8 cache's includes a digest of its scales, so
        # engines with other scales (or bf16 KV) never read each other's chunks
        key = PoolKey(self.model_id, kv_cache.layout.value, kv_cache.format_key(),
                      spec.num_layers, spec.num_kv_heads, spec.head_size, bs, chunk_blocks, tp_rank, tp_size, pp_rank)
        if groups:
            keys = [replace(key, dtype=c.format_key(), num_layers=len(g.layers),
                            group=f"g{i}-full" if g.window is None else f"g{i}-w{g.window}")
                    for i, (g, c) in enumerate(zip(groups, kv_cache.caches))]
            self.worker.register_kv_caches(kv_cache, keys)
        else:
            self.worker.register_kv_caches(kv_cache, key)
        server = self.worker.server  # rank 0's: the scheduler side asks it through the lookup bridge
        client = LookupClient(server.address, self.lookup_timeout_s) if server is not None else None
        self.scheduler.bind_geometry(geometry, client)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "store_kind": self.store_kind}


def _holders(store: Any, options: dict[str, Any]) -> list[tuple[str, str]] | None:
    """``holders`` ({client address: segment} of a pool's holders on this host, as ``hwkv pool master
    --holders N`` prints it), popped from ``options`` and checked; ``None`` when not given."""
    holders = options.pop("holders", None)
    if holders is None:
        return None
    if store != "mooncake":
        raise ValueError("pool: holders apply to store='mooncake' only")
    if options.get("holder") is not None:
        raise ValueError("pool: give holder= (one holder) or holders= (several), not both")
    if not isinstance(holders, dict) or not holders:
        raise ValueError(f"pool: holders={holders!r} is invalid (need a non-empty dict of 'host:port' the engine "
                         "attaches at -> 'host:port' of that holder's segment, as `hwkv pool master` prints)")
    for a, s in holders.items():
        for v in (a, s):
            host, _, port = v.rpartition(":") if isinstance(v, str) else ("", "", "")
            if not host or not port.isdigit():
                raise ValueError(f"pool: holders entry {a!r}: {s!r} is invalid (need 'host:port': 'host:port')")
    if len(set(holders.values())) != len(holders):
        raise ValueError("pool: holders name one segment twice (each holder has its own)")
    return list(holders.items())


def _shutdown_sides(scheduler: PoolScheduler, worker: PoolWorker) -> None:
    scheduler.shutdown()
    worker.shutdown()

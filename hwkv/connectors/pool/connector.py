"""Global KV pool connector (``pool``): prefix KV shared across engine instances through a Store
(the design of vllm-ascend's AscendStore / Mooncake store connector; docs/connectors.md maps it).

The unit is a *chunk* of ``chunk_size`` tokens (a multiple of the block size, default one block),
keyed by :class:`~hwkv.connectors.pool.key.PoolKey` (model identity, KV layout and dtype, shard,
the prefix-cache chain hash of the chunk's last block).

Scheduler side:

* lookup (``get_num_new_matched_tokens``): the chunks after the local prefix-cache hit, up to the
  last prompt token, are asked of the worker side through the lookup bridge (ZMQ REQ/REP, one
  batched ``exists``); the leading present ones are offered as an asynchronous load. A lookup that
  fails or times out is a miss. A local hit that ends inside a chunk offers nothing (the chunk's
  blocks are partly someone else's).
* admission (``update_state_after_alloc``): the offer becomes a load job into the request's new
  blocks, pinned until the job completes; the request waits in WAITING_FOR_REMOTE_KVS.
* every step (``build_connector_meta``): newly full chunks of scheduled requests become store jobs
  (pinned until put), unless a put of theirs completed recently (a local set) or is in flight.
* completions (``update_connector_output``): pins released, counters; a failed load's request is
  never offered the pool again (it recomputes).

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

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hwkv.connectors.base.jobs import Meta, ReqState
from hwkv.connectors.pool.key import PoolKey, default_model_id
from hwkv.connectors.pool.lookup import LookupClient, LookupServer
from hwkv.connectors.pool.store import StoreHandle, store_factory
from hwkv.connectors.pool.transfer import PoolTransfer
from hwkv.connectors.pool.worker import PoolWorker
from hwkv.core.kv_events import MEDIUM_POOL, BlockRemoved, BlockStored
from hwkv.core.sched_output import KVConnectorOutput

_RECENT_MAX = 1 << 16  # chunk hashes known to be in the pool (puts and loads that completed)
_LOOKUP_TTL_S = 1.0  # a waiting request that is not admitted re-asks at most this often


@dataclass
class _Job:
    job_id: int
    load: bool
    req_id: str
    blocks: list[Any]  # pinned device KVCacheBlocks, chunk after chunk
    hashes: list[bytes]


def _positive(name: str, v: Any, integer: bool = False) -> None:
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or v <= 0:
        raise ValueError(f"pool: {name}={v!r} is invalid (need a positive {'int' if integer else 'number'})")


class PoolConnector(PoolWorker):
    """Units are chunks. Meta: loads ``(job, request, hashes, blocks per chunk)``, stores ``(job, hashes,
    blocks per chunk)``; completions ``(job, ok, bytes, chunks already in the pool)`` under ``extra["pool"]``."""

    name = "pool"

    def __init__(self, store: Any = "embedded", chunk_size: int | None = None, model_id: str | None = None,
                 tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, lookup_timeout_s: float = 1.0,
                 load_timeout_s: float = 10.0, retry_s: float = 2.0, lookup_address: str | None = None,
                 staging_bytes: int = 64 << 20, save: bool = True, **store_options: Any):
        if chunk_size is not None:
            _positive("chunk_size", chunk_size, integer=True)
        for name, v in (("lookup_timeout_s", lookup_timeout_s), ("load_timeout_s", load_timeout_s),
                        ("retry_s", retry_s)):
            _positive(name, v)
        _positive("staging_bytes", staging_bytes, integer=True)
        if model_id is not None and (not isinstance(model_id, str) or not model_id or "@" in model_id):
            raise ValueError(f"pool: model_id={model_id!r} is invalid (need a non-empty str without '@')")
        factory, owned = store_factory(store, store_options)
        self.handle = StoreHandle(factory, owned, float(retry_s))
        self.store_kind = store if isinstance(store, str) else type(store).__name__
        self.chunk_size, self.model_id = chunk_size, model_id
        self.shard = (tp_rank, tp_size, pp_rank)
        self.lookup_timeout_s, self.load_timeout_s = float(lookup_timeout_s), float(load_timeout_s)
        self.lookup_address, self.staging_bytes, self.save = lookup_address, staging_bytes, bool(save)
        self._init_jobs()
        self.key: PoolKey | None = None
        self.block_size = self.chunk_blocks = 0
        self._chunk_bytes = 1
        self._pending: dict[str, tuple[int, list[bytes]]] = {}  # rid -> (first chunk, hit hashes)
        self._lookups: dict[str, tuple[tuple[int, int], int, float]] = {}
        self._recent: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[Any] | None = None  # KV events (medium "POOL"), once enabled
        self._epoch: tuple[int, int] = (0, 0)  # (connects, failures) of the store the worker last reported
        self.counters = dict(loaded_bytes=0, stored_bytes=0, lookups=0, lookup_hit_tokens=0, load_jobs=0,
                             failed_loads=0, load_timeouts=0, store_jobs=0, stored_chunks=0, dedup_pool=0,
                             dedup_local=0, failed_stores=0)
        self._init_worker()

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
        self.block_size, self.chunk_blocks = bs, chunk // bs
        self._chunk_bytes = self.chunk_blocks * spec.bytes_per_block * self.tp_size  # every shard's bytes
        # the dtype part is the cache's format key: an fp8 cache's includes a digest of its scales, so
        # engines with other scales (or bf16 KV) never read each other's chunks
        self.key = PoolKey(self.model_id, kv_cache.layout.value, kv_cache.format_key(),
                           spec.num_layers, spec.num_kv_heads, spec.head_size, bs, self.chunk_blocks,
                           tp_rank, tp_size, pp_rank)
        self.transfer = PoolTransfer(self.handle, self.dev, kv_cache, self.chunk_blocks, self.staging_bytes)
        self.handle.register(self.transfer.buffers())  # connects now if it can; else on first use
        if self.tp_rank == 0:  # the scheduler side's; the other ranks of a tensor-parallel engine serve none
            self.server = LookupServer(self._count_hits, self.lookup_address)
            self.client = LookupClient(self.server.address, self.lookup_timeout_s)

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._pending.pop(rid, None)
        if self.client is None or rid in self._no_offer:
            return 0, False
        bs, cb = self.block_size, self.chunk_blocks
        if num_computed_tokens % (bs * cb):
            return 0, False
        first = num_computed_tokens // (bs * cb)
        last = min((request.num_tokens - 1) // bs, len(request.block_hashes)) // cb  # last token: computed
        if last <= first:
            return 0, False
        now = time.monotonic()
        cached = self._lookups.get(rid)
        if cached is not None and cached[0] == (first, last) and now - cached[2] < _LOOKUP_TTL_S:
            hits = cached[1]
        else:
            hashes = [request.block_hashes[(c + 1) * cb - 1] for c in range(first, last)]
            hits = self.client.lookup(hashes)
            self._lookups[rid] = ((first, last), hits, now)
            self.counters["lookups"] += 1
            gone = [h for h in hashes[hits:] if h in self._recent]
            for h in gone:  # missing from the pool (evicted, or a master restarted empty): a
                del self._recent[h]  # "recently put" entry is stale; the sender's exists check still dedups
            self._removed(gone)
        if not hits:
            return 0, False
        self._pending[rid] = (first, [request.block_hashes[(c + 1) * cb - 1] for c in range(first, first + hits)])
        return hits * cb * bs, True

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._reqs[rid] = ReqState(request)
        first, hashes = self._pending.pop(rid, (0, []))
        n = min(len(hashes), num_external_tokens // (self.block_size * self.chunk_blocks))
        if not n:
            return
        cb = self.chunk_blocks
        blocks = self.kv.get_blocks(rid)[first * cb:(first + n) * cb]
        self._add_job(_Job(next(self._ids), True, rid, blocks, hashes[:n]), blocks)
        self.counters["lookup_hit_tokens"] += n * cb * self.block_size

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads = self._take_loads(scheduler_output)
        stores = self._prepare_stores(scheduler_output) if self.save and self.key is not None else []
        if not loads and not stores:
            return None
        return Meta([(j.job_id, j.req_id, j.hashes, self._chunks(j.blocks)) for j in loads],
                     [(j.job_id, j.hashes, self._chunks(j.blocks)) for j in stores])

    def _chunks(self, blocks: list[Any]) -> list[list[int]]:
        cb = self.chunk_blocks
        return [[b.block_id for b in blocks[i:i + cb]] for i in range(0, len(blocks), cb)]

    def _prepare_stores(self, so: Any) -> list[_Job]:
        bs, cb, out = self.block_size, self.chunk_blocks, []
        for rid in so.num_scheduled_tokens:
            st = self._reqs.get(rid)
            if st is None or st.hold:
                continue
            req, blocks = st.request, self.kv.get_blocks(rid)
            full = min(req.num_computed_tokens // bs, len(req.block_hashes), len(blocks)) // cb
            hashes, dev = [], []
            for c in range(st.num_stored, full):
                h = req.block_hashes[(c + 1) * cb - 1]
                if h in self._recent:
                    self._recent.move_to_end(h)
                    self.counters["dedup_local"] += 1
                elif h not in self._storing:
                    hashes.append(h)
                    dev.extend(blocks[c * cb:(c + 1) * cb])
            st.num_stored = max(st.num_stored, full)
            if hashes:
                self._storing.update(hashes)  # pinned: a put reads them after this step's forward
                out.append(self._add_job(_Job(next(self._ids), False, rid, dev, hashes), dev))
        return out

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        epoch = output.extra.get("pool_epoch")
        if epoch is not None and epoch != self._epoch:  # the store failed or was reconnected: it may have
            self._epoch = epoch  # lost anything, so "recently put" proves nothing any more
            self._removed(list(self._recent))
            self._recent.clear()
        super().update_connector_output(output)

    def _complete(self, job: _Job, ok: bool, nbytes: int, skipped: int) -> None:
        c = self.counters
        if job.load:
            c["load_jobs" if ok else "failed_loads"] += 1
            c["loaded_bytes"] += nbytes
            if ok and (st := self._reqs.get(job.req_id)) is not None:
                st.hold = False
        else:
            self._storing.difference_update(job.hashes)
            c["store_jobs" if ok else "failed_stores"] += 1
            c["stored_bytes"] += nbytes
            c["stored_chunks"] += nbytes // self._chunk_bytes
            c["dedup_pool"] += skipped
        if ok:  # known present: later stores of these chunks skip even the exists call
            new = [h for h in job.hashes if h not in self._recent] if self._events is not None else None
            for h in job.hashes:
                self._recent[h] = None
                self._recent.move_to_end(h)
            if new:
                self._events.append(BlockStored(new, None, [], self.block_size * self.chunk_blocks, None,  # type: ignore
                                                MEDIUM_POOL))
            trimmed = []
            while len(self._recent) > _RECENT_MAX:
                trimmed.append(self._recent.popitem(last=False)[0])
            self._removed(trimmed)
        self.kv.block_pool.free_blocks(job.blocks)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # In-flight jobs pin their blocks themselves: freeing the request's blocks now is safe.
        rid = request.request_id
        self._pending.pop(rid, None)
        self._lookups.pop(rid, None)
        self._forget(rid)
        return False, None

    # ---- KV events (medium "POOL") ----------------------------------------------------------------
    # What this instance knows the pool holds: chunks it put or found there (stored), chunks a lookup
    # found gone or that a store failure/reconnect puts in doubt (removed), and the oldest ones past
    # the bounded set of known chunks (removed: no longer vouched for). One hash per chunk: the chain
    # hash of its last block, block_size the chunk's tokens (with the default one-block chunks, the
    # device cache's block hashes). The pool is shared: a router may read any instance's POOL events
    # as every instance's.
    def enable_kv_events(self) -> None:
        self._events = []

    def take_kv_events(self) -> list[Any]:
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def kv_event_snapshot(self) -> list[Any]:
        if self._events is None or not self._recent:
            return []
        return [BlockStored(list(self._recent), None, [], self.block_size * self.chunk_blocks, None, MEDIUM_POOL)]

    def _removed(self, hashes: list[bytes]) -> None:
        if hashes and self._events is not None:
            self._events.append(BlockRemoved(hashes, MEDIUM_POOL))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["store_kind"] = self.store_kind
        out["chunk_size"] = self.block_size * self.chunk_blocks
        out["transfers_in_flight"] = len(self._jobs)
        out["last_load_error"], out["last_store_error"] = self.last_errors["load"], self.last_errors["store"]
        if self.client is not None:
            out["lookup_timeouts"], out["lookup_errors"] = self.client.timeouts, self.client.errors
            out["lookup_last_error"] = self.client.last_error
        out.update(self.handle.stats())
        return out

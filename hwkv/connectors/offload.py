"""CPU offload connector: a host-memory tier of KV blocks behind the device prefix cache (the
protocol of vLLM's CPU offload connector; docs/connectors.md maps it step by step).

Scheduler side: the tier is a :class:`~hwkv.core.block_pool.BlockPool` of host blocks keyed by the
same chained block hashes as the device prefix cache (salts included), so a host hit is exactly a
prefix-cache hit one tier down, with the pool's LRU free queue as the tier's eviction order.

* lookup (``get_num_new_matched_tokens``): the blocks after the device hit whose hashes the tier
  holds, consecutive from there; they are touched (pinned) at once and kept as a *pending hit*
  (a request that is then not admitted releases it on its next lookup, finish or abort);
* admission (``update_state_after_alloc``): the pending hit becomes a load job (host → device
  blocks); both sides stay pinned until the job's completion event;
* every step (``build_connector_meta``): newly full device blocks of scheduled requests whose hash
  the tier lacks become a store job (device → host) into freshly allocated host blocks (evicting
  the LRU ones), once ``store_batch_blocks`` of them wait, and a finishing request's remaining ones
  at once (before its blocks can be reused); both sides pinned; a block already in the tier only
  moves to its MRU end;
* completions (``update_connector_output``): pins released; a stored block's hash is registered
  only now, so no lookup ever sees a block whose bytes are still in flight.

Worker side: loads run on a load stream that first waits for the compute stream (a reused device
block may still be written by the previous forward); the compute stream waits for a synchronous
load's event before the forward. Stores run on a store stream after an event recorded behind the
forward. Completion is polled with ``Event.query`` — never a host sync on the compute path.

Failures: a load that cannot be issued is reported in ``failed_recving`` in the same step (the
scheduler discards that step's token and recomputes); the request is never offered the tier again.
An asynchronous load (``async_load=True``) still running after ``load_timeout_s`` is reported
failed too; its blocks stay pinned until the copy ends, so nothing is reused under it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import takewhile
from typing import Any

from hwkv.connectors.copy import copy_block_pairs
from hwkv.connectors.jobs import JobConnector, Meta, ReqState
from hwkv.core.block_pool import BlockPool, KVCacheBlock
from hwkv.core.sched_output import KVConnectorOutput


@dataclass
class _Job:
    """One transfer: ``load`` (host → device, for ``req_id``) or store (device → host)."""

    job_id: int
    load: bool
    req_id: str
    host: list[KVCacheBlock]
    device: list[KVCacheBlock]
    hashes: list[bytes] = field(default_factory=list)  # store: registered on completion
    is_async: bool = False


@dataclass
class _Flight:
    job_id: int
    event: Any
    ok: bool
    req_id: str = ""
    is_async: bool = False
    t0: float = 0.0
    reported: bool = False


class OffloadConnector(JobConnector):
    """Meta: loads ``(job, req, host ids, device ids, async)``, stores ``(job, device ids, host ids)``;
    completions ``(job, ok)`` under ``extra["offload"]``."""

    name = "offload"
    _extra_key = "offload"

    def __init__(self, cpu_bytes: int, min_run_blocks: int = 4, store: bool = True, async_load: bool = False,
                 load_timeout_s: float | None = None, store_batch_blocks: int = 32):
        if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes <= 0:
            raise ValueError(f"offload: cpu_bytes must be a positive int (bytes of host memory), got {cpu_bytes!r}")
        if not isinstance(min_run_blocks, int) or isinstance(min_run_blocks, bool) or min_run_blocks < 1:
            raise ValueError(f"offload: min_run_blocks must be an int >= 1, got {min_run_blocks!r}")
        if not isinstance(store_batch_blocks, int) or isinstance(store_batch_blocks, bool) or store_batch_blocks < 1:
            raise ValueError(f"offload: store_batch_blocks must be an int >= 1, got {store_batch_blocks!r}")
        if load_timeout_s is not None and not (isinstance(load_timeout_s, (int, float)) and load_timeout_s > 0):
            raise ValueError(f"offload: load_timeout_s must be > 0 seconds or None, got {load_timeout_s!r}")
        self.cpu_bytes, self.min_run_blocks = cpu_bytes, min_run_blocks
        self.store, self.async_load, self.load_timeout_s = bool(store), bool(async_load), load_timeout_s
        self.store_batch_blocks = store_batch_blocks
        self._init_jobs()
        self.cpu: BlockPool | None = None  # the host tier (created with the device KV cache)
        self.block_size = 0
        self._pending_hits: dict[str, tuple[int, list[KVCacheBlock]]] = {}  # rid -> (first block, pinned hits)
        self._finished_stores: list[tuple[int, list[int], list[int]]] = []  # issued with the next step
        self.counters = dict(loaded_bytes=0, stored_bytes=0, load_jobs=0, store_jobs=0, hit_blocks=0,
                             stores_skipped_full=0, failed_loads=0)
        # worker side
        self.device_kv: Any = None
        self.host_kv: Any = None
        self._flights: list[_Flight] = []

    # ---- set-up --------------------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: Any) -> None:
        spec = kv_cache.spec
        n = self.cpu_bytes // spec.bytes_per_block
        if n < 1:
            raise ValueError(f"offload: cpu_bytes={self.cpu_bytes} holds no KV block (one block of all layers is "
                             f"{spec.bytes_per_block} bytes; allowed: cpu_bytes >= {spec.bytes_per_block})")
        self.device_kv, self.block_size = kv_cache, spec.block_size
        self.host_kv = self.dev.allocate_kv_cache(replace(spec, num_blocks=n), kv_cache.layout, host=True)
        self.cpu = BlockPool(n, enable_caching=True)
        self._load_stream, self._store_stream = self.dev.new_stream(), self.dev.new_stream()

    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._release_hit(rid)  # stale: from a lookup that was not admitted
        if self.cpu is None or rid in self._no_offer:
            return 0, False
        bs = self.block_size
        start, end = num_computed_tokens // bs, (request.num_tokens - 1) // bs  # the last token is computed
        get = self.cpu.cached_block_hash_to_block.get
        hits = list(takewhile(lambda b: b is not None, map(get, request.block_hashes[start:end])))
        if not hits:
            return 0, False
        self.cpu.touch(hits)  # pinned until admitted (then until loaded) or released
        self._pending_hits[rid] = (start, hits)
        return len(hits) * bs, self.async_load

    def _release_hit(self, rid: str) -> None:
        pending = self._pending_hits.pop(rid, None)
        if pending is not None:
            self.cpu.free_blocks(pending[1])  # type: ignore[union-attr]

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        self._reqs[rid] = ReqState(request)
        start, hits = self._pending_hits.pop(rid, (0, []))
        n = -(-num_external_tokens // self.block_size) if hits else 0
        if hits[n:]:
            self.cpu.free_blocks(hits[n:])  # type: ignore[union-attr]
        if not n:
            return
        device = self.kv.get_blocks(rid)[start:start + n]
        self._add_job(_Job(next(self._ids), True, rid, hits[:n], device, is_async=self.async_load), device)
        self.counters["hit_blocks"] += n

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads = self._take_loads(scheduler_output)
        stores = self._prepare_stores(scheduler_output) if self.store and self.cpu is not None else []
        if not loads and not stores:
            return None
        return Meta([(j.job_id, j.req_id, [b.block_id for b in j.host], [b.block_id for b in j.device], j.is_async)
                      for j in loads], stores)

    def _prepare_stores(self, so: Any) -> list[tuple[int, list[int], list[int]]]:
        """Store jobs of this step: the newly full blocks of scheduled requests, once at least
        ``store_batch_blocks`` are waiting (fewer, larger copies), plus finished requests' last ones."""
        bs, reqs, waiting, ready = self.block_size, self._reqs, 0, []
        for rid in so.num_scheduled_tokens:
            st = reqs.get(rid)
            if st is None or st.hold:
                continue
            req = st.request
            full = min(req.num_computed_tokens // bs, len(req.block_hashes))
            if full > st.num_stored:
                waiting += full - st.num_stored
                ready.append(st)
        out, self._finished_stores = self._finished_stores, []
        if waiting >= self.store_batch_blocks:
            out += [job for st in ready if (job := self._store_job(st)) is not None]
        return out

    def _store_job(self, st: ReqState) -> tuple[int, list[int], list[int]] | None:
        """Pin the request's full blocks not yet stored and host blocks for those the tier lacks
        (evicting LRU ones); the copy runs after this step's forward."""
        cpu, cached = self.cpu, self.cpu.cached_block_hash_to_block  # type: ignore[union-attr]
        req, rid = st.request, st.request.request_id
        blocks = self.kv.get_blocks(rid)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(blocks))
        todo = []
        for i in range(st.num_stored, full):
            h = req.block_hashes[i]
            if (b := cached.get(h)) is not None:
                cpu.touch((b,))  # already in the tier: refresh its LRU position (before evicting
                cpu.free_blocks((b,))  # for the new ones, so this request never evicts its own)
            elif h not in self._storing:
                todo.append(i)
        st.num_stored = max(st.num_stored, full)
        n = min(len(todo), cpu.num_free_blocks)  # a host block pinned by a transfer is no capacity
        self.counters["stores_skipped_full"] += len(todo) - n
        if not n:
            return None
        host = cpu.get_new_blocks(n)
        device = [blocks[i] for i in todo[:n]]
        hashes = [req.block_hashes[i] for i in todo[:n]]
        self._storing.update(hashes)
        job = self._add_job(_Job(next(self._ids), False, rid, host, device, hashes), device)
        return job.job_id, [b.block_id for b in device], [b.block_id for b in host]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.counters["failed_loads"] += len(output.failed_recving)
        super().update_connector_output(output)

    def _complete(self, job: _Job, ok: bool) -> None:
        # every rank moved its shard of the blocks (tensor parallelism: tp_size shards of equal size)
        cpu, nbytes = self.cpu, len(job.host) * self.device_kv.spec.bytes_per_block * self.tp_size
        if job.load:
            st = self._reqs.get(job.req_id)
            if st is not None and ok:
                st.hold = False
            if ok:
                self.counters["loaded_bytes"] += nbytes
                self.counters["load_jobs"] += 1
        else:
            self._storing.difference_update(job.hashes)
            if ok:  # registered only now: a lookup never sees bytes still in flight
                for b, h in zip(job.host, job.hashes):
                    if h not in cpu.cached_block_hash_to_block:  # type: ignore[union-attr]
                        b.block_hash = h
                        cpu.cached_block_hash_to_block[h] = b  # type: ignore[union-attr]
                self.counters["stored_bytes"] += nbytes
                self.counters["store_jobs"] += 1
        cpu.free_blocks(job.host)  # type: ignore[union-attr]  # cached ones join the LRU at the MRU end
        self.kv.block_pool.free_blocks(job.device)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # In-flight transfers pin their device blocks themselves: freeing the request's blocks now is safe.
        rid = request.request_id
        self._release_hit(rid)
        st = self._forget(rid)
        # its last blocks are stored before they can be reused
        if st is not None and not st.hold and self.store and self.cpu is not None and \
                (job := self._store_job(st)) is not None:
            self._finished_stores.append(job)
        return False, None

    def stats(self) -> dict[str, Any]:
        cpu = self.cpu
        out: dict[str, Any] = dict(self.counters)
        out["cpu_blocks"] = cpu.num_blocks if cpu is not None else 0
        out["cpu_cached_blocks"] = len(cpu.cached_block_hash_to_block) if cpu is not None else 0
        out["cpu_evictions"] = cpu.stats.evictions if cpu is not None else 0
        out["transfers_in_flight"] = len(self._jobs)
        return out

    # ---- worker side ---------------------------------------------------------------------------
    def load_blocks(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Queue one request's host → device copies on the load stream (tests inject failures here)."""
        copy_block_pairs(self.dev, self.host_kv, self.device_kv, host_ids, device_ids, self._load_stream,
                         self.min_run_blocks)

    def start_load_kv(self) -> None:
        loads = self._issue(loads=True)
        if not loads:
            return
        dev, stream = self.dev, self._load_stream
        ready = dev.new_event()
        ready.record()  # the compute stream's work so far: a reused block's last writer
        stream.wait_event(ready)
        last_sync = None
        for job_id, rid, host_ids, device_ids, is_async in loads:
            try:
                self.load_blocks(host_ids, device_ids)
                ok = True
            except Exception:  # reported, then recomputed: never wrong tokens
                ok = False
                self._failed_now.add(rid)
            ev = dev.new_event()
            ev.record(stream)
            self._flights.append(_Flight(job_id, ev, ok, rid, is_async, time.monotonic(), reported=not ok))
            if ok and not is_async:
                last_sync = ev
        if last_sync is not None:
            dev.current_stream().wait_event(last_sync)  # the forward reads the loaded blocks

    def wait_for_save(self) -> None:
        stores = self._issue(loads=False)
        if not stores:
            return
        dev, stream = self.dev, self._store_stream
        written = dev.new_event()
        written.record()  # behind this step's forward: the blocks it fills are written
        stream.wait_event(written)
        # one batched copy for every store of the step (a launch per KV tensor, not per request)
        device_ids = [b for _, d, _ in stores for b in d]
        host_ids = [b for _, _, h in stores for b in h]
        try:
            copy_block_pairs(dev, self.device_kv, self.host_kv, device_ids, host_ids, stream, self.min_run_blocks)
            ok = True
        except Exception:
            ok = False  # the tier just does not get these blocks
        ev = dev.new_event()
        ev.record(stream)
        self._flights += [_Flight(job_id, ev, ok) for job_id, _, _ in stores]

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        done, recv, failed = self._take_done()
        still, now = [], time.monotonic()
        for f in self._flights:
            if f.event.query():
                done.append((f.job_id, f.ok))
                if f.is_async and not f.reported:
                    recv.add(f.req_id)
                continue
            if f.is_async and not f.reported and self.load_timeout_s is not None and now - f.t0 > self.load_timeout_s:
                f.reported = True  # its blocks stay pinned until the copy really ends
                failed.add(f.req_id)
            still.append(f)
        self._flights = still
        if not (done or recv or failed):
            return None
        return KVConnectorOutput(finished_recving=recv, failed_recving=failed, extra={"offload": done})

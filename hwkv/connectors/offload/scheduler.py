"""The offload connector's scheduler side (:class:`OffloadScheduler`; the connector:
:mod:`hwkv.connectors.offload.connector`, docs/connectors.md maps the protocol step by step).

The tier is a :class:`~hwkv.connectors.offload.tier.HostTier` of host blocks keyed by the
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
* preemption (``request_preempted``, before the blocks are freed): the request's computed full
  blocks the tier lacks become a store job that pins only host blocks: its copy is issued first
  thing in the step's ``start_load_kv`` and the compute stream waits for it, so the freed device
  blocks are read before anything can overwrite them and the preemption frees all of them at once.
  So no full block leaves the device unstored, and a re-admitted request loads its prefix from the
  tier instead of recomputing it. A request that finishes or is preempted while a load into its
  blocks is unconfirmed has its store *parked* (device blocks pinned) until that load completes;
* completions (``update_connector_output``): pins released; a stored block's hash is registered
  only now, so no lookup ever sees a block whose bytes are still in flight.

KV-cache groups (a hybrid model, docs/hybrid-models.md): one host tier per group (each of
``HostTierGeometry.num_blocks`` blocks of that group's layers), keyed by the same hashes. A host hit
of ``n`` blocks after a device hit of ``start`` needs, in a full group, blocks ``[start, n)`` and in a
window group only ``[max(start, first_needed(n)), n)`` (what the next query sees); the longest ``n``
every group serves is loaded, and the window group's blocks before that window are freed at once
(never loaded, so never registered). Window blocks leave the device every step, so with groups the
newly full blocks are stored every step (not batched), and a window group stores only its live ones.
A job's host and device ids are *flat* over the groups: group ``g``'s block ``b`` is
``offset[g] + b`` (device: the sizes of the groups before it; host: ``g * num_blocks``).

Failures: a load that cannot be issued is reported in ``failed_recving`` in the same step (the
scheduler discards that step's token and recomputes); the request is never offered the tier again.
An asynchronous load (``async_load=True``) still running after ``load_timeout_s`` is reported
failed too; its blocks stay pinned until the copy ends, so nothing is reused under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hwkv.connectors.base.jobs import JobScheduler, ReqState
from hwkv.connectors.offload.tier import HostTier, HostTierGeometry
from hwkv.connectors.offload.worker import OffloadMeta
from hwkv.core.block_pool import KVCacheBlock
from hwkv.core.kv_events import MEDIUM_CPU, BlockStored
from hwkv.interfaces.connector import KVConnectorOutput


@dataclass
class _Job:
    """One transfer: ``load`` (host → device, for ``req_id``) or store (device → host)."""

    job_id: int
    load: bool
    req_id: str
    host: list[KVCacheBlock]
    device: list[KVCacheBlock]  # pinned ones (a preempted request's store pins none)
    hashes: list[bytes] = field(default_factory=list)  # store: registered on completion
    is_async: bool = False
    groups: list[int] = field(default_factory=list)  # the KV-cache group of each host block ([]: all group 0)


class OffloadScheduler(JobScheduler):
    """The protocol above; the per-step metadata is an :class:`~hwkv.connectors.offload.worker.OffloadMeta`,
    the completions come back as ``(job, ok)`` under ``extra["offload"]``."""

    extra_key = "offload"

    def __init__(self, store: bool, async_load: bool, store_batch_blocks: int) -> None:
        super().__init__()
        self.store, self.async_load, self.store_batch_blocks = store, async_load, store_batch_blocks
        self.geometry: HostTierGeometry | None = None
        self.cpu: HostTier | None = None  # created with the device KV cache (bind_geometry); group 0's
        self.cpus: list[HostTier] = []  # one per KV-cache group
        self.windows: list[int | None] = [None]  # each group's window (None: full attention)
        self.grouped = False  # the device KV-cache manager has groups (job ids are flat over them)
        self._block_bytes: list[int] = []  # bytes of one block of each group
        self.block_size = 0
        self._pending_hits: dict[str, tuple[int, list[KVCacheBlock]]] = {}  # rid -> (first block, pinned hits)
        self._finished_stores: list[tuple[int, list[int], list[int]]] = []  # issued with the next step
        self._preempted_stores: list[tuple[int, list[int], list[int]]] = []  # issued before its forward
        self._parked: dict[int, list[tuple[int, list[int], list[int]]]] = {}  # load job -> stores waiting on it
        self.counters = dict(loaded_bytes=0, stored_bytes=0, load_jobs=0, store_jobs=0, hit_blocks=0,
                             stores_skipped_full=0, failed_loads=0, preempted_store_blocks=0)

    def bind_geometry(self, geometry: HostTierGeometry, group_layers: list[int] | None = None) -> None:
        """The tier's size, known once the device KV cache exists (its block size and bytes per block;
        ``group_layers``: the layers of each KV-cache group, None without groups)."""
        self.geometry, self.block_size = geometry, geometry.block_size
        self.grouped = hasattr(self.kv, "managers")
        mgrs = self._managers()
        layers = group_layers or [1]
        self._block_bytes = [geometry.bytes_per_block * n // sum(layers) for n in layers]
        self.windows = [getattr(m, "window", None) for m in mgrs]
        self.cpus = [HostTier(geometry.num_blocks) for _ in mgrs]
        self.cpu = self.cpus[0]
        self._dev_off = [sum(m.block_pool.num_blocks for m in mgrs[:g]) for g in range(len(mgrs))]

    def _managers(self) -> list[Any]:
        """The device KV-cache manager of each group (one without groups)."""
        return list(getattr(self.kv, "managers", [self.kv]))

    def _lo(self, g: int, start: int, n: int) -> int:
        """First block group ``g`` needs of a hit ending at block ``n`` after a device hit of ``start``."""
        w = self.windows[g]
        return start if w is None else max(start, max(0, n * self.block_size - w + 1) // self.block_size)

    def _storing_key(self, g: int, h: bytes) -> Any:
        return h if g == 0 else (g, h)

    def _pin(self, job: Any, blocks: list[Any]) -> None:
        if not job.groups:
            return super()._pin(job, blocks)
        pools = [m.block_pool for m in self._managers()]
        for g, b in zip(job.groups, blocks):  # each group's blocks in its own pool
            pools[g].touch((b,))

    def _unpin(self, job: _Job) -> None:
        if not job.groups:
            self.cpu.free_blocks(job.host)  # type: ignore[union-attr]  # cached ones join the LRU at the MRU end
            self.kv.block_pool.free_blocks(job.device)
            return
        pools = [m.block_pool for m in self._managers()]
        for g, cpu in enumerate(self.cpus):
            cpu.free_blocks([b for b, x in zip(job.host, job.groups) if x == g])
            if job.device:
                pools[g].free_blocks([b for b, x in zip(job.device, job.groups) if x == g])

    def _host_ids(self, job: _Job) -> list[int]:
        n = self.geometry.num_blocks  # type: ignore[union-attr]
        if not job.groups:
            return [b.block_id for b in job.host]
        return [b.block_id + g * n for b, g in zip(job.host, job.groups)]

    def _dev_ids(self, job: _Job, device: list[KVCacheBlock]) -> list[int]:
        off = self._dev_off
        return [b.block_id + off[g] for b, g in zip(device, job.groups)] if job.groups else [b.block_id for b in device]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._release_hit(rid)  # stale: from a lookup that was not admitted
        if self.cpu is None or rid in self._no_offer:
            return 0, False
        bs = self.block_size
        start, end = num_computed_tokens // bs, (request.num_tokens - 1) // bs  # the last token is computed
        n = self._longest_hit(request.block_hashes, start, end)
        if n <= start:
            return 0, False
        hits = [cpu.match(request.block_hashes[self._lo(g, start, n):n]) for g, cpu in enumerate(self.cpus)]
        for cpu, h in zip(self.cpus, hits):
            cpu.touch(h)  # pinned until admitted (then until loaded) or released
        self._pending_hits[rid] = (start, n, hits)
        return (n - start) * bs, self.async_load

    def _longest_hit(self, hashes: list[bytes], start: int, end: int) -> int:
        """The largest ``n <= end`` every group's tier serves from block ``start`` (a full group: every
        block of ``[start, n)``; a window group: the blocks of ``[start, n)`` the next query sees);
        ``start``: none."""
        n = end
        for g, cpu in enumerate(self.cpus):
            if self.windows[g] is None:
                n = min(n, start + len(cpu.match(hashes[start:end])))
        windowed = [(g, cpu.cached_block_hash_to_block) for g, cpu in enumerate(self.cpus)
                    if self.windows[g] is not None]
        while n > start and not all(all(hashes[i] in have for i in range(self._lo(g, start, n), n))
                                    for g, have in windowed):
            n -= 1  # a window's blocks at a shorter prefix differ: try each
        return n

    def _release_hit(self, rid: str) -> None:
        pending = self._pending_hits.pop(rid, None)
        if pending is not None:
            for cpu, hits in zip(self.cpus, pending[2]):
                cpu.free_blocks(hits)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        self._reqs[rid] = ReqState(request)
        pending = self._pending_hits.pop(rid, None)
        if pending is None:
            return
        start, end, hits = pending
        n = start + -(-num_external_tokens // self.block_size)
        n = min(n, end)
        if n > start and any(self._lo(g, start, n) < self._lo(g, start, end) for g in range(len(hits))):
            raise RuntimeError(f"offload: request {rid!r} was admitted with a shorter host hit than offered, "
                               "whose window is not pinned")  # the scheduler only cuts to num_tokens - 1
        keep = []
        for g, (cpu, h) in enumerate(zip(self.cpus, hits)):
            first = self._lo(g, start, end)  # hits[g] are the blocks [first, end)
            a, b = (self._lo(g, start, n) - first, n - first) if n > start else (0, 0)
            keep.append(h[a:b])
            cpu.free_blocks(h[:a] + h[b:])
        if n <= start:
            return
        mgrs = self._managers()
        host, device, groups = [], [], []
        for g, (m, k) in enumerate(zip(mgrs, keep)):
            host += k
            device += m.get_blocks(rid)[self._lo(g, start, n):n]
            groups += [g] * len(k)
            if self.windows[g] is not None:  # blocks before the loaded window: never loaded, never read
                m.free_outside_window(request, n * self.block_size)
        job = _Job(next(self._ids), True, rid, host, device, is_async=self.async_load,
                   groups=groups if self.grouped else [])
        self._add_job(job, device)
        self.counters["hit_blocks"] += n - start

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads = self._take_loads(scheduler_output)
        stores = self._prepare_stores(scheduler_output) if self.store and self.cpu is not None else []
        early, self._preempted_stores = self._preempted_stores, []
        if not loads and not stores and not early:
            return None
        return OffloadMeta([(j.job_id, j.req_id, self._host_ids(j), self._dev_ids(j, j.device), j.is_async)
                            for j in loads], stores, early_stores=early)

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
        if waiting >= self.store_batch_blocks or self.grouped:  # window blocks leave every step
            out += [job for st in ready if (job := self._store_job(st)) is not None]
        return out

    def _store_job(self, st: ReqState, pin: bool = True) -> tuple[int, list[int], list[int]] | None:
        """Host blocks (evicting LRU ones) for the request's computed full blocks not yet stored that
        the tier lacks (in each group; a window group's live ones only); the device blocks are pinned
        (``pin``) until the copy ends, or not (a preempted request's: the copy is issued before its
        step's forward)."""
        req, rid = st.request, st.request.request_id
        tables = [m.get_blocks(rid) for m in self._managers()]
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(tables[0]))
        first, st.num_stored = st.num_stored, max(st.num_stored, full)
        host, device, hashes, groups = [], [], [], []
        for g, (cpu, blocks) in enumerate(zip(self.cpus, tables)):
            live = [i for i in range(first, full) if not blocks[i].is_null]
            # already in the tier: refreshed first, so this request never evicts its own blocks
            have = cpu.refresh_all([req.block_hashes[i] for i in live])
            todo = [i for i, hit in zip(live, have)
                    if not hit and self._storing_key(g, req.block_hashes[i]) not in self._storing]
            got = cpu.reserve(len(todo))  # a pinned host block is no capacity
            self.counters["stores_skipped_full"] += len(todo) - len(got)
            todo = todo[:len(got)]
            host += got
            device += [blocks[i] for i in todo]
            hashes += [req.block_hashes[i] for i in todo]
            groups += [g] * len(todo)
            self._storing.update(self._storing_key(g, req.block_hashes[i]) for i in todo)
        if not host:
            return None
        job = _Job(next(self._ids), False, rid, host, device if pin else [], hashes,
                   groups=groups if self.grouped else [])
        self._add_job(job, job.device)
        return job.job_id, self._dev_ids(job, device), self._host_ids(job)

    def request_preempted(self, request: Any) -> None:
        rid = request.request_id
        self._release_hit(rid)
        st = self._reqs.pop(rid, None)  # re-admission starts afresh
        if st is None or not self.store or self.cpu is None:
            return
        if st.hold:
            job = self._park(st)
        elif (job := self._store_job(st, pin=False)) is not None:
            self._preempted_stores.append(job)
        if job is not None:
            self.counters["preempted_store_blocks"] += len(job[1])

    def _park(self, st: ReqState) -> tuple[int, list[int], list[int]] | None:
        """A request leaving while a load into its blocks is unconfirmed (on a device its event may
        fire steps after the step that used it): what it computed on top is valid only if the load
        was, so the store pins the device blocks and waits for the load's completion."""
        load = next((j for j in self._jobs.values() if j.load and j.req_id == st.request.request_id), None)
        job = self._store_job(st) if load is not None else None
        if job is not None:
            self._parked.setdefault(load.job_id, []).append(job)  # type: ignore[union-attr]
        return job

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.counters["failed_loads"] += len(output.failed_recving)
        super().update_connector_output(output)

    def _complete(self, job: _Job, ok: bool) -> None:
        # every rank moved its shard of the blocks (tensor parallelism: tp_size shards of equal size)
        nbytes = sum(self._block_bytes[g] for g in job.groups or [0] * len(job.host)) * self.tp_size
        if job.load:
            st = self._reqs.get(job.req_id)
            if st is not None and ok:
                st.hold = False
            parked = self._parked.pop(job.job_id, [])
            if ok:
                self._finished_stores += parked  # issued after the next forward, device blocks pinned
            for store_id, *_ in () if ok else parked:
                self._complete(self._jobs.pop(store_id), False)
            if ok:
                self.counters["loaded_bytes"] += nbytes
                self.counters["load_jobs"] += 1
        else:
            keys = [self._storing_key(g, h) for g, h in zip(job.groups, job.hashes)] if job.groups else job.hashes
            self._storing.difference_update(keys)
            if ok:  # registered only now: a lookup never sees bytes still in flight
                for g, cpu in enumerate(self.cpus):
                    sel = [i for i, x in enumerate(job.groups or [0] * len(job.host)) if x == g]
                    cpu.publish([job.host[i] for i in sel], [job.hashes[i] for i in sel])
                self.counters["stored_bytes"] += nbytes
                self.counters["store_jobs"] += 1
        self._unpin(job)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # In-flight transfers pin their device blocks themselves: freeing the request's blocks now is safe.
        rid = request.request_id
        self._release_hit(rid)
        st = self._forget(rid)
        # its last blocks are stored before they can be reused
        if st is not None and self.store and self.cpu is not None:
            if st.hold:
                self._park(st)
            elif (job := self._store_job(st)) is not None:
                self._finished_stores.append(job)
        return False, None

    # ---- KV events (medium "CPU": the host tier's registered hashes) ---------------------------------
    def enable_kv_events(self) -> None:
        if self.cpu is not None:
            self.cpu.enable_kv_events(self.block_size, MEDIUM_CPU)

    def take_kv_events(self) -> list[Any]:
        return self.cpu.take_kv_events() if self.cpu is not None else []

    def kv_event_snapshot(self) -> list[Any]:
        cpu = self.cpu
        if cpu is None or not cpu.cached_block_hash_to_block:
            return []
        return [BlockStored(list(cpu.cached_block_hash_to_block), None, [], self.block_size, None, MEDIUM_CPU)]

    def stats(self) -> dict[str, Any]:
        cpu = self.cpu
        out: dict[str, Any] = dict(self.counters)
        out["cpu_blocks"] = cpu.num_blocks if cpu is not None else 0
        out["cpu_cached_blocks"] = len(cpu.cached_block_hash_to_block) if cpu is not None else 0
        out["cpu_evictions"] = cpu.stats.evictions if cpu is not None else 0
        out["transfers_in_flight"] = len(self._jobs)
        if self.grouped:  # the counters above are group 0's tier; each group's (docs/hybrid-models.md)
            out["cpu_cached_blocks_per_group"] = [len(c.cached_block_hash_to_block) for c in self.cpus]
        return out

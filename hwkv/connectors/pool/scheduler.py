"""The pool connector's scheduler side (:class:`PoolScheduler`; the connector:
:mod:`hwkv.connectors.pool.connector`, docs/connectors.md maps the protocol).

Through the lookup bridge of :class:`~hwkv.connectors.pool.lookup.LookupClient` it asks the worker
side's lookup server (rank 0) which chunks the pool holds; the unit is a chunk of
``PoolGeometry.chunk_blocks`` blocks.

* lookup (``get_num_new_matched_tokens``): the chunks after the local prefix-cache hit, up to the
  last prompt token, are asked of the worker side through the lookup bridge (ZMQ REQ/REP, one
  batched ``exists``); the leading present ones are offered as an asynchronous load. A lookup that
  fails or times out is a miss. A local hit that ends inside a chunk offers the rest of that chunk
  (and the chunks after it): the chunk is got whole and only its blocks after the hit are written —
  its leading blocks are the device cache's, shared, and stay as they are (with KV-cache groups that
  have a window such a hit offers nothing).
* admission (``update_state_after_alloc``): the offer becomes a load job into the request's new
  blocks, pinned until the job completes; the request waits in WAITING_FOR_REMOTE_KVS.
* every step (``build_connector_meta``): newly full chunks of scheduled requests become store jobs
  (pinned until put), unless a put of theirs completed recently (a local set) or is in flight.
* completions (``update_connector_output``): pins released, counters; a failed load's request is
  never offered the pool again (it recomputes from the first chunk that did not land: the worker
  side reports ``valid_tokens``).

KV-cache groups (a hybrid model, docs/hybrid-models.md): each group's chunks have their own keys.
The lookup asks which chunks each group holds (one ``presence`` request); a hit of ``n`` chunks
needs, in a full group, every chunk of ``[first, n)``, in a window group only the chunks covering
the window of the next query, ``[max(first, first_needed(n) // chunk_blocks), n)``; the offer is
the longest ``n`` every group serves. Admission makes one load job per group (a window group's
blocks before its loaded window are freed first: never loaded, so never registered); the request
is loaded once every group's job ended. Stores: each group's newly full chunks whose blocks it
still holds (a window group frees a block only at the step after it became full, so in practice
every chunk), one job per group.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from hwkv.connectors.base.jobs import JobScheduler, Meta, ReqState
from hwkv.connectors.pool.lookup import LookupClient
from hwkv.core.kv_events import MEDIUM_POOL, BlockRemoved, BlockStored
from hwkv.interfaces.connector import KVConnectorOutput

_RECENT_MAX = 1 << 16  # chunk hashes known to be in the pool (puts and loads that completed)
_LOOKUP_TTL_S = 1.0  # a waiting request that is not admitted re-asks at most this often


@dataclass(frozen=True)
class PoolGeometry:
    """What both sides know of the chunks: the worker moves ``chunk_blocks`` blocks per key, the
    scheduler offers and stores whole chunks."""

    block_size: int
    chunk_blocks: int
    chunk_bytes: int  # one chunk of every tensor-parallel shard (the bytes counters' unit)
    group_layers: tuple[int, ...] = ()  # KV-cache groups: each group's layers (a group's chunk is its share)


@dataclass
class _Job:
    job_id: int
    load: bool
    req_id: str
    blocks: list[Any]  # pinned device KVCacheBlocks, chunk after chunk
    hashes: list[bytes]
    group: int = 0  # the KV-cache group whose blocks these are
    first: int = 0  # a load: the index of its first chunk in the request
    skip: int = 0  # a load: leading blocks of its first chunk the device cache had (pinned, never written)


class PoolScheduler(JobScheduler):
    """Units are chunks. Meta: loads ``(job, request, hashes, blocks per chunk)``, stores ``(job, hashes,
    blocks per chunk)``; completions ``(job, ok, bytes, chunks already in the pool)`` under ``extra["pool"]``."""

    extra_key = "pool"

    def __init__(self, save: bool) -> None:
        super().__init__()
        self.save = save
        self.client: LookupClient | None = None  # rank 0's lookup bridge; None: nothing is offered
        self.windows: list[int | None] = [None]  # each KV-cache group's window (None: full attention)
        self.block_size = self.chunk_blocks = 0
        self._chunk_bytes = 1
        self._group_chunk_bytes = [1]
        self._pending: dict[str, tuple[int, int, list[bytes]]] = {}  # rid -> (first chunk, blocks of it
        # the device cache had, hit hashes)
        self._lookups: dict[str, tuple[tuple[int, int], int, float]] = {}
        # chunks known to be in the pool: group 0's by hash, another group's as (group, hash)
        self._recent: OrderedDict[Any, None] = OrderedDict()
        self._events: list[Any] | None = None  # KV events (medium "POOL"), once enabled
        self._epoch: tuple[int, int] = (0, 0)  # (connects, failures) of the store the worker last reported
        self.counters = dict(loaded_bytes=0, stored_bytes=0, lookups=0, lookup_hit_tokens=0, load_jobs=0,
                             failed_loads=0, store_jobs=0, stored_chunks=0, dedup_pool=0, dedup_local=0,
                             failed_stores=0, lookup_s=0.0)

    def bind_geometry(self, geometry: PoolGeometry, client: LookupClient | None) -> None:
        """The chunks' shape, and the lookup bridge (``None`` on a rank that serves no scheduler)."""
        self.block_size, self.chunk_blocks, self._chunk_bytes = (geometry.block_size, geometry.chunk_blocks,
                                                                 geometry.chunk_bytes)
        self.client = client
        self.windows = [getattr(m, "window", None) for m in self._managers()]
        layers = geometry.group_layers or (1,)
        self._group_chunk_bytes = [max(1, geometry.chunk_bytes * n // sum(layers)) for n in layers]

    @property
    def grouped(self) -> bool:
        """KV-cache groups with a window: the per-group lookup (a window needs only its chunks)."""
        return any(w is not None for w in self.windows)

    def _managers(self) -> list[Any]:
        """The device KV-cache manager of each group (one without groups)."""
        return list(getattr(self.kv, "managers", [self.kv]))

    def _key(self, g: int, h: bytes) -> Any:
        return h if g == 0 else (g, h)

    def _lo(self, g: int, first: int, n: int) -> int:
        """First chunk group ``g`` needs of a hit ending at chunk ``n`` after a local hit of ``first`` chunks."""
        w, cb, bs = self.windows[g], self.chunk_blocks, self.block_size
        return first if w is None else max(first, max(0, n * cb * bs - w + 1) // bs // cb)

    def _pin(self, job: Any, blocks: list[Any]) -> None:
        self._managers()[job.group].block_pool.touch(blocks)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid = request.request_id
        self._pending.pop(rid, None)
        if self.client is None or rid in self._no_offer:
            return 0, False
        bs, cb = self.block_size, self.chunk_blocks
        # A local hit ending inside a chunk: that chunk is loaded whole and only its blocks after the
        # hit are written (KV-cache groups with a window: not offered, as their chunk windows need it)
        if num_computed_tokens % bs or (num_computed_tokens % (bs * cb) and self.grouped):
            return 0, False
        first = num_computed_tokens // (bs * cb)
        skip = num_computed_tokens // bs - first * cb
        last = min((request.num_tokens - 1) // bs, len(request.block_hashes)) // cb  # last token: computed
        if last <= first:
            return 0, False
        now = time.monotonic()
        cached = self._lookups.get(rid)
        if cached is not None and cached[0] == (first, last) and now - cached[2] < _LOOKUP_TTL_S:
            hits = cached[1]
        elif self.grouped:
            hits = self._grouped_hits(request, first, last)
            self._lookups[rid] = ((first, last), hits, now)
        else:
            hashes = [request.block_hashes[(c + 1) * cb - 1] for c in range(first, last)]
            hits = self.client.lookup(hashes)
            self.counters["lookup_s"] += time.monotonic() - now  # the bridge and the store's exists
            self._lookups[rid] = ((first, last), hits, now)
            self.counters["lookups"] += 1
            gone = [h for h in hashes[hits:] if h in self._recent]
            for h in gone:  # missing from the pool (evicted, or a master restarted empty): a
                del self._recent[h]  # "recently put" entry is stale; the sender's exists check still dedups
            self._removed(gone)
        if not hits:
            return 0, False
        self._pending[rid] = (first, skip,
                              [request.block_hashes[(c + 1) * cb - 1] for c in range(first, first + hits)])
        return (hits * cb - skip) * bs, True

    def _grouped_hits(self, request: Any, first: int, last: int) -> int:
        """Chunks after ``first`` every group serves (module docstring): a full group needs each chunk
        from ``first``, a window group those covering the next query's window (each ``n`` tried from the
        full groups' longest run down: a shorter prefix's window is other chunks)."""
        cb = self.chunk_blocks
        hashes = [request.block_hashes[(c + 1) * cb - 1] for c in range(first, last)]
        t0 = time.monotonic()
        present = self.client.presence(hashes, len(self.windows))  # type: ignore[union-attr]
        self.counters["lookup_s"] += time.monotonic() - t0  # the bridge and the store's exists
        self.counters["lookups"] += 1
        n = last
        for g, w in enumerate(self.windows):
            if w is None:
                n = min(n, first + next((i for i, p in enumerate(present[g]) if not p), len(hashes)))
        while n > first and not all(all(present[g][c - first] for c in range(self._lo(g, first, n), n))
                                    for g, w in enumerate(self.windows) if w is not None):
            n -= 1
        for g, flags in enumerate(present):  # missing from the pool: a "recently put" entry is stale
            gone = [h for h, p in zip(hashes, flags) if not p and self._key(g, h) in self._recent]
            for h in gone:
                del self._recent[self._key(g, h)]
            if g == 0:
                self._removed(gone)
        return n - first

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._reqs[rid] = ReqState(request)
        first, skip, hashes = self._pending.pop(rid, (0, 0, []))
        n = min(len(hashes), (num_external_tokens + skip * self.block_size) // (self.block_size * self.chunk_blocks))
        if not n:
            return
        cb, bs, end = self.chunk_blocks, self.block_size, first + n
        for g, m in enumerate(self._managers()):
            lo = self._lo(g, first, end)
            if self.windows[g] is not None:  # its entries before the window are never loaded: freed now (the
                # load holds only the window, and a failed load's landed blocks, registered up to valid_tokens,
                # never include them; a test fails without it). Not before `lo`: when the window starts inside
                # the device hit, those hit blocks are the window's (lo is clamped to the hit; a test fails so)
                start = self._lo(g, 0, end)
                m.free_outside_window(request, start * cb * bs + self.windows[g] - 1)  # frees blocks [0, start * cb)
            blocks = m.get_blocks(rid)[lo * cb:end * cb]
            self._add_job(_Job(next(self._ids), True, rid, blocks, hashes[lo - first:n], g, lo,
                               skip if lo == first else 0), blocks)
        self.counters["lookup_hit_tokens"] += (n * cb - skip) * bs

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads = self._take_loads(scheduler_output)
        stores = self._prepare_stores(scheduler_output) if self.save and self.client is not None else []
        if not loads and not stores:
            return None
        return Meta([(j.job_id, j.req_id, j.hashes, self._chunks(j.blocks, j.skip), j.group, j.first) for j in loads],
                     [(j.job_id, j.hashes, self._chunks(j.blocks), j.group) for j in stores])

    def _chunks(self, blocks: list[Any], skip: int = 0) -> list[list[int]]:
        """Block ids per chunk; the first ``skip`` are -1 (a load must not write them)."""
        cb = self.chunk_blocks
        ids = [-1] * skip + [b.block_id for b in blocks[skip:]]
        return [ids[i:i + cb] for i in range(0, len(ids), cb)]

    def _prepare_stores(self, so: Any) -> list[_Job]:
        bs, cb, out = self.block_size, self.chunk_blocks, []
        for rid in so.num_scheduled_tokens:
            st = self._reqs.get(rid)
            if st is None or st.hold:
                continue
            req, tables = st.request, [m.get_blocks(rid) for m in self._managers()]
            full = min(req.num_computed_tokens // bs, len(req.block_hashes), len(tables[0])) // cb
            for g, blocks in enumerate(tables):
                hashes, dev = [], []
                for c in range(st.num_stored, full):
                    h = req.block_hashes[(c + 1) * cb - 1]
                    k = self._key(g, h)
                    if k in self._recent:
                        self._recent.move_to_end(k)
                        self.counters["dedup_local"] += 1
                    elif k not in self._storing and not any(b.is_null for b in blocks[c * cb:(c + 1) * cb]):
                        hashes.append(h)  # (a window group's chunk it no longer holds is skipped)
                        dev.extend(blocks[c * cb:(c + 1) * cb])
                if hashes:
                    self._storing.update(self._key(g, h) for h in hashes)  # pinned: a put reads them after
                    out.append(self._add_job(_Job(next(self._ids), False, rid, dev, hashes, g), dev))  # the forward
            st.num_stored = max(st.num_stored, full)
        return out

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        epoch = output.extra.get("pool_epoch")
        if epoch is not None and epoch != self._epoch:  # the store failed or was reconnected: it may have
            self._epoch = epoch  # lost anything, so "recently put" proves nothing any more
            self._removed([k for k in self._recent if isinstance(k, bytes)])
            self._recent.clear()
        super().update_connector_output(output)

    def _complete(self, job: _Job, ok: bool, nbytes: int, skipped: int) -> None:
        c, g = self.counters, job.group
        keys = [self._key(g, h) for h in job.hashes]
        if job.load:
            c["load_jobs" if ok else "failed_loads"] += 1
            c["loaded_bytes"] += nbytes
            mine = any(j.load and j.req_id == job.req_id for j in self._jobs.values())  # another group's
            if ok and not mine and (st := self._reqs.get(job.req_id)) is not None:
                st.hold = False
        else:
            self._storing.difference_update(keys)
            c["store_jobs" if ok else "failed_stores"] += 1
            c["stored_bytes"] += nbytes
            c["stored_chunks"] += nbytes // self._group_chunk_bytes[g]  # (with groups: every group's chunks)
            c["dedup_pool"] += skipped
        if ok:  # known present: later stores of these chunks skip even the exists call
            # KV events report group 0's chunks (the full group's where there is one)
            new = [h for h in job.hashes if h not in self._recent] if self._events is not None and not g else None
            for k in keys:
                self._recent[k] = None
                self._recent.move_to_end(k)
            if new:
                self._events.append(BlockStored(new, None, [], self.block_size * self.chunk_blocks, None,  # type: ignore
                                                MEDIUM_POOL))
            trimmed = []
            while len(self._recent) > _RECENT_MAX:
                trimmed.append(self._recent.popitem(last=False)[0])
            self._removed([k for k in trimmed if isinstance(k, bytes)])
        self._managers()[g].block_pool.free_blocks(job.blocks)

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
        hashes = [k for k in self._recent if isinstance(k, bytes)] if self._events is not None else []
        if not hashes:
            return []
        return [BlockStored(hashes, None, [], self.block_size * self.chunk_blocks, None, MEDIUM_POOL)]

    def _removed(self, hashes: list[bytes]) -> None:
        if hashes and self._events is not None:
            self._events.append(BlockRemoved(hashes, MEDIUM_POOL))

    def merge_tp_job(self, key: str, a: list[Any], b: list[Any]) -> list[Any]:
        return [a[0] + b[0], min(a[1], b[1])]  # bytes of every shard; a chunk skipped only where every shard was

    def merge_tp_extra(self, key: str, values: list[Any]) -> Any:
        if key != "pool_epoch":
            return super().merge_tp_extra(key, values)
        # any rank's store reconnecting or failing changes the sum: "recently put" proves nothing then
        return tuple(sum(v[i] for v in values if v is not None) for i in range(2))

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters)
        out["chunk_size"] = self.block_size * self.chunk_blocks
        out["transfers_in_flight"] = len(self._jobs)
        if self.client is not None:
            out["lookup_timeouts"], out["lookup_errors"] = self.client.timeouts, self.client.errors
            out["lookup_last_error"] = self.client.last_error
        return out

    def shutdown(self) -> None:
        if self.client is not None:
            with contextlib.suppress(OSError):
                self.client.close()
        self.client = None

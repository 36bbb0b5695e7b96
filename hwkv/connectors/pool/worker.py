"""The pool connector's worker side (:class:`PoolWorker`): the store client, the lookup server
(rank 0) and the sending/receiving threads, fed one step's gets and puts; completions and timeouts
come back through ``get_finished``.

A get starts behind an event recorded on the compute stream (a reused block's last writer); a put
behind an event recorded after this step's forward (the blocks it fills are written). A get that
runs past ``load_timeout_s`` is reported failed at once; its blocks stay pinned until it really
ends. Reports carry the store's ``(connects, failures)`` epoch (a changed epoch is reported even
with nothing else), so the scheduler side forgets "recently put" chunks whenever the store failed
or reconnected.

KV-cache groups (a hybrid model): one :class:`PoolTransfer` per group, over that group's KV cache,
under that group's key (``PoolKey.group``); a request's load is one get per group, reported done
once every group's get ended, failed if any failed — then with ``valid_tokens``: the tokens up to
the first chunk that did not land, in any group (each get knows where its chunks start).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from hwkv.connectors.base.jobs import JobWorker
from hwkv.connectors.pool.key import PoolKey
from hwkv.connectors.pool.lookup import LookupServer
from hwkv.connectors.pool.store import StoreHandle
from hwkv.connectors.pool.transfer import GetJob, PoolTransfer, PutJob
from hwkv.interfaces.connector import KVConnectorOutput
from hwkv.interfaces.store import StoreError


@dataclass
class _Flight:
    req_id: str
    t0: float
    reported: bool = False
    start: int = 0  # the token its first chunk starts at
    end: int = 0  # the token after its last chunk


class PoolWorker(JobWorker):
    """Completions go out as ``(job, ok, bytes, chunks already in the pool)`` under ``extra["pool"]``."""

    fail_details = (0, 0)

    def __init__(self, handle: StoreHandle, load_timeout_s: float, staging_bytes: int,
                 lookup_address: str | None, pack: bool = False, load_parallel: int = 1,
                 lane_handles: list[StoreHandle] | None = None, segments: list[str] | None = None,
                 locator: StoreHandle | None = None) -> None:
        super().__init__()
        self.pack, self.load_parallel = pack, load_parallel
        self.lane_handles = lane_handles or []  # more store clients for loads (load_clients - 1, other holders')
        # several holders: the holder segment of each load client (the main one first) and a plain
        # client that asks the master where values live; a load reads each through its holder's client
        self.segments, self.locator = segments, locator
        self.handle, self.load_timeout_s = handle, load_timeout_s
        self.staging_bytes, self.lookup_address = staging_bytes, lookup_address
        self.key: PoolKey | None = None  # group 0's (the only one without groups)
        self.keys: list[PoolKey] = []  # one per KV-cache group
        self.transfer: PoolTransfer | None = None  # group 0's
        self.transfers: list[PoolTransfer] = []
        self.chunk_tokens = 0
        # a request whose load is ending: (the smallest valid end of its failed gets so far, or None)
        self._ending: dict[str, int | None] = {}
        self.server: LookupServer | None = None
        self._flights: dict[int, _Flight] = {}
        self._sent_epoch: tuple[int, int] = (0, 0)
        self.load_timeouts = 0
        self.last_errors = {"load": "", "store": ""}  # why the latest failed get / put failed (stats)

    def register_kv_caches(self, kv_cache: Any, key: PoolKey | list[PoolKey] | None = None) -> None:
        """Start the transfer threads over ``kv_cache`` for chunks of ``key.chunk_blocks`` blocks
        under ``key`` (the connector derives it from the cache; KV-cache groups: one key per group,
        ``kv_cache.caches`` in the same order), and on rank 0 the lookup server."""
        if key is None:
            raise ValueError("pool: the worker side needs the pool key of this cache")
        self.keys = list(key) if isinstance(key, list) else [key]
        self.key = self.keys[0]
        caches = getattr(kv_cache, "caches", None) or [kv_cache]
        if len(caches) != len(self.keys):
            raise ValueError(f"pool: {len(self.keys)} keys for {len(caches)} KV-cache groups")
        self.chunk_tokens = self.key.chunk_blocks * caches[0].spec.block_size
        alloc = self.handle.host_memory()  # a holder-mode store: staging in its shared memory
        lanes = [(h, h.host_memory()) for h in self.lane_handles]
        layers = [c.spec.num_layers for c in caches]  # the staging bytes are shared in proportion
        locate = partial(self.locator.call, "locate") if self.locator is not None else None
        self.transfers = [PoolTransfer(self.handle, self.dev, c, self.key.chunk_blocks,
                                       max(1, self.staging_bytes * n // sum(layers)), alloc, self.pack,
                                       self.load_parallel, lanes, self.segments, locate)
                          for c, n in zip(caches, layers)]
        self.transfer = self.transfers[0]
        self.handle.register([b for t in self.transfers for b in t.buffers()])  # connects now if it can
        for j, h in enumerate(self.lane_handles, 1):
            h.register([b for t in self.transfers for b in t.lane_buffers(j)])
        if self.locator is not None:  # connects now: its setup (~0.14 s) must not land on the first load
            self.locator.register([])
        if self.tp_rank == 0:  # the scheduler side's; the other ranks of a tensor-parallel engine serve none
            self.server = LookupServer(self._count_hits, self.lookup_address,
                                       self._presence if getattr(kv_cache, "caches", None) else None)

    def _count_hits(self, hashes: list[bytes]) -> int:
        """Worker side, lookup server thread: leading chunks present in the pool — under tensor
        parallelism, present for every rank's shard (one batched ``exists`` over all their keys)."""
        keys = [replace(self.key, tp_rank=r) for r in range(self.tp_size)]  # type: ignore[type-var]
        present = self.handle.call("exists", [k for key in keys for k in key.keys(hashes)])
        n, m = 0, len(hashes)
        while n < m and all(present[r * m + n] for r in range(len(keys))):
            n += 1
        return n

    def _presence(self, hashes: list[bytes]) -> list[bool]:
        """Lookup server thread, KV-cache groups: per group (group-major), per hash, that group's
        chunk is in the pool for every rank's shard (one batched ``exists``)."""
        keys = [replace(k, tp_rank=r) for k in self.keys for r in range(self.tp_size)]
        present = self.handle.call("exists", [x for key in keys for x in key.keys(hashes)])
        m, t = len(hashes), self.tp_size
        return [all(present[((g * t) + r) * m + i] for r in range(t)) for g in range(len(self.keys)) for i in range(m)]

    def start_load_kv(self) -> None:
        loads = self._issue(loads=True)
        if not loads:
            return
        ready = self.dev.new_event()
        ready.record()  # the compute stream's work so far: a reused block's last writer
        now = time.monotonic()
        for job_id, rid, hashes, chunks, *where in loads:
            g, first = where if where else (0, 0)  # (group, its first chunk's index)
            ct = self.chunk_tokens
            self._flights[job_id] = _Flight(rid, now, start=first * ct, end=(first + len(hashes)) * ct)
            self.transfers[g].submit_get(GetJob(job_id, rid, self.keys[g].keys(hashes), chunks, ready, now))

    def wait_for_save(self) -> None:
        stores = self._issue(loads=False)
        if not stores:
            return
        written = self.dev.new_event()
        written.record()  # behind this step's forward: the blocks it fills are written
        for job_id, hashes, chunks, *group in stores:
            g = group[0] if group else 0
            self.transfers[g].submit_put(PutJob(job_id, self.keys[g].keys(hashes), chunks, written))

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        done, recv, failed = self._take_done()
        ended: set[str] = set()  # requests with a get that ended in this call
        for d in (d for t in self.transfers for d in t.drain()):
            done.append((d.job_id, d.ok, d.nbytes, d.skipped))
            if d.error or not d.ok:
                self.last_errors["load" if d.load else "store"] = d.error or "unknown"
            f = self._flights.pop(d.job_id, None) if d.load else None
            if f is not None and not f.reported:
                self._end(f.req_id, None if d.ok else f.start + d.landed * self.chunk_tokens)
                ended.add(f.req_id)
        now = time.monotonic()
        for f in self._flights.values():
            if not f.reported and now - f.t0 > self.load_timeout_s:
                f.reported = True  # its blocks stay pinned until the get really ends
                self._end(f.req_id, 0)  # nothing of it is known to have landed
                ended.add(f.req_id)
                self.load_timeouts += 1
                self.last_errors["load"] = f"a get ran past load_timeout_s={self.load_timeout_s}"
        valid: dict[str, int] = {}
        for rid in ended:
            mine = [f for f in self._flights.values() if f.req_id == rid]
            if any(not f.reported for f in mine):
                continue  # another group's get of it is still running: one report, once all ended
            for f in mine:
                f.reported = True
            end = self._ending.pop(rid, None)
            if end is None:
                recv.add(rid)
            else:
                failed.add(rid)
                if end:
                    valid[rid] = end
        epoch = (self.handle.connects, self.handle.failures)
        if not (done or recv or failed) and epoch == self._sent_epoch:
            return None
        self._sent_epoch = epoch
        return KVConnectorOutput(finished_recving=recv, failed_recving=failed, valid_tokens=valid,
                                 extra={"pool": done, "pool_epoch": epoch})

    def _end(self, rid: str, valid: int | None) -> None:
        """A get of ``rid`` ended: ok (``None``) or failed with its chunks valid up to token ``valid``."""
        if rid not in self._ending:
            self._ending[rid] = None
        if valid is not None:
            prev = self._ending[rid]
            self._ending[rid] = valid if prev is None else min(prev, valid)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(load_timeouts=self.load_timeouts, last_load_error=self.last_errors["load"],
                                   last_store_error=self.last_errors["store"])
        out.update(self.handle.stats())
        if self.transfer is not None:  # summed over the KV-cache groups' transfers
            out.update({k: round(sum(t.timing[k] for t in self.transfers), 6) for k in self.transfer.timing})
            out["packed_loads"] = self.transfer.packed  # pack=True took effect (one block per chunk, staging)
        return out

    def shutdown(self) -> None:
        """Stop the threads and the lookup server; close an owned store client. Idempotent."""
        for part in (self.server, *self.transfers):
            if part is not None:
                with contextlib.suppress(StoreError, OSError):
                    part.close()
        self.server = self.transfer = None
        self.transfers = []
        self.handle.close()
        for h in (*self.lane_handles, *([self.locator] if self.locator is not None else [])):
            h.close()

"""The pool connector's worker side (:class:`PoolWorker`): the store client, the lookup server
(rank 0) and the sending/receiving threads, fed one step's gets and puts; completions and timeouts
come back through ``get_finished``.

A get starts behind an event recorded on the compute stream (a reused block's last writer); a put
behind an event recorded after this step's forward (the blocks it fills are written). A get that
runs past ``load_timeout_s`` is reported failed at once; its blocks stay pinned until it really
ends. Reports carry the store's ``(connects, failures)`` epoch (a changed epoch is reported even
with nothing else), so the scheduler side forgets "recently put" chunks whenever the store failed
or reconnected.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
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


class PoolWorker(JobWorker):
    """Completions go out as ``(job, ok, bytes, chunks already in the pool)`` under ``extra["pool"]``."""

    fail_details = (0, 0)

    def __init__(self, handle: StoreHandle, load_timeout_s: float, staging_bytes: int,
                 lookup_address: str | None, pack: bool = False) -> None:
        super().__init__()
        self.pack = pack
        self.handle, self.load_timeout_s = handle, load_timeout_s
        self.staging_bytes, self.lookup_address = staging_bytes, lookup_address
        self.key: PoolKey | None = None
        self.transfer: PoolTransfer | None = None
        self.server: LookupServer | None = None
        self._flights: dict[int, _Flight] = {}
        self._sent_epoch: tuple[int, int] = (0, 0)
        self.load_timeouts = 0
        self.last_errors = {"load": "", "store": ""}  # why the latest failed get / put failed (stats)

    def register_kv_caches(self, kv_cache: Any, key: PoolKey | None = None) -> None:
        """Start the transfer threads over ``kv_cache`` for chunks of ``key.chunk_blocks`` blocks
        under ``key`` (the connector derives it from the cache), and on rank 0 the lookup server."""
        if key is None:
            raise ValueError("pool: the worker side needs the pool key of this cache")
        self.key = key
        alloc = self.handle.host_memory()  # a holder-mode store: staging in its shared memory
        self.transfer = PoolTransfer(self.handle, self.dev, kv_cache, key.chunk_blocks, self.staging_bytes, alloc,
                                     self.pack)
        self.handle.register(self.transfer.buffers())  # connects now if it can; else on first use
        if self.tp_rank == 0:  # the scheduler side's; the other ranks of a tensor-parallel engine serve none
            self.server = LookupServer(self._count_hits, self.lookup_address)

    def _count_hits(self, hashes: list[bytes]) -> int:
        """Worker side, lookup server thread: leading chunks present in the pool — under tensor
        parallelism, present for every rank's shard (one batched ``exists`` over all their keys)."""
        keys = [replace(self.key, tp_rank=r) for r in range(self.tp_size)]  # type: ignore[type-var]
        present = self.handle.call("exists", [k for key in keys for k in key.keys(hashes)])
        n, m = 0, len(hashes)
        while n < m and all(present[r * m + n] for r in range(len(keys))):
            n += 1
        return n

    def start_load_kv(self) -> None:
        loads = self._issue(loads=True)
        if not loads:
            return
        ready = self.dev.new_event()
        ready.record()  # the compute stream's work so far: a reused block's last writer
        now = time.monotonic()
        for job_id, rid, hashes, chunks in loads:
            self._flights[job_id] = _Flight(rid, now)
            self.transfer.submit_get(GetJob(job_id, rid, self.key.keys(hashes), chunks, ready, now))  # type: ignore

    def wait_for_save(self) -> None:
        stores = self._issue(loads=False)
        if not stores:
            return
        written = self.dev.new_event()
        written.record()  # behind this step's forward: the blocks it fills are written
        for job_id, hashes, chunks in stores:
            self.transfer.submit_put(PutJob(job_id, self.key.keys(hashes), chunks, written))  # type: ignore

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        done, recv, failed = self._take_done()
        for d in self.transfer.drain() if self.transfer is not None else ():
            done.append((d.job_id, d.ok, d.nbytes, d.skipped))
            if d.error or not d.ok:
                self.last_errors["load" if d.load else "store"] = d.error or "unknown"
            f = self._flights.pop(d.job_id, None) if d.load else None
            if f is not None and not f.reported:
                (recv if d.ok else failed).add(f.req_id)
        now = time.monotonic()
        for f in self._flights.values():
            if not f.reported and now - f.t0 > self.load_timeout_s:
                f.reported = True  # its blocks stay pinned until the get really ends
                failed.add(f.req_id)
                self.load_timeouts += 1
                self.last_errors["load"] = f"a get ran past load_timeout_s={self.load_timeout_s}"
        epoch = (self.handle.connects, self.handle.failures)
        if not (done or recv or failed) and epoch == self._sent_epoch:
            return None
        self._sent_epoch = epoch
        return KVConnectorOutput(finished_recving=recv, failed_recving=failed,
                                 extra={"pool": done, "pool_epoch": epoch})

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(load_timeouts=self.load_timeouts, last_load_error=self.last_errors["load"],
                                   last_store_error=self.last_errors["store"])
        out.update(self.handle.stats())
        if self.transfer is not None:
            out.update({k: round(v, 6) for k, v in self.transfer.timing.items()})
            out["packed_loads"] = self.transfer.packed  # pack=True took effect (one block per chunk, staging)
        return out

    def shutdown(self) -> None:
        """Stop the threads and the lookup server; close an owned store client. Idempotent."""
        for part in (self.server, self.transfer):
            if part is not None:
                with contextlib.suppress(StoreError, OSError):
                    part.close()
        self.server = self.transfer = None
        self.handle.close()

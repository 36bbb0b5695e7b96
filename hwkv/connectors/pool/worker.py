"""The pool connector's worker side: the store client, the lookup server (rank 0) and the
sending/receiving threads, fed one step's gets and puts; completions and timeouts come back
through ``get_finished``.

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

from hwkv.connectors.base.jobs import JobConnector
from hwkv.connectors.pool.key import PoolKey
from hwkv.connectors.pool.lookup import LookupClient, LookupServer
from hwkv.connectors.pool.store import StoreHandle
from hwkv.connectors.pool.transfer import GetJob, PoolTransfer, PutJob
from hwkv.core.sched_output import KVConnectorOutput
from hwkv.interfaces.store import StoreError


@dataclass
class _Flight:
    req_id: str
    t0: float
    reported: bool = False


class PoolWorker(JobConnector):
    """Worker half of :class:`~hwkv.connectors.pool.connector.PoolConnector`; completions go out as
    ``(job, ok, bytes, chunks already in the pool)`` under ``extra["pool"]``."""

    _extra_key = "pool"
    _fail_details = (0, 0)
    handle: StoreHandle
    key: PoolKey | None
    load_timeout_s: float
    counters: dict[str, int]

    def _init_worker(self) -> None:
        self.transfer: PoolTransfer | None = None
        self.server: LookupServer | None = None
        self.client: LookupClient | None = None
        self._flights: dict[int, _Flight] = {}
        self._sent_epoch: tuple[int, int] = (0, 0)
        self.last_errors = {"load": "", "store": ""}  # why the latest failed get / put failed (stats)

    def merge_tp_job(self, key: str, a: list[Any], b: list[Any]) -> list[Any]:
        return [a[0] + b[0], min(a[1], b[1])]  # bytes of every shard; a chunk skipped only where every shard was

    def merge_tp_extra(self, key: str, values: list[Any]) -> Any:
        if key != "pool_epoch":
            return super().merge_tp_extra(key, values)
        # any rank's store reconnecting or failing changes the sum: "recently put" proves nothing then
        return tuple(sum(v[i] for v in values if v is not None) for i in range(2))

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
                self.counters["load_timeouts"] += 1
                self.last_errors["load"] = f"a get ran past load_timeout_s={self.load_timeout_s}"
        epoch = (self.handle.connects, self.handle.failures)
        if not (done or recv or failed) and epoch == self._sent_epoch:
            return None
        self._sent_epoch = epoch
        return KVConnectorOutput(finished_recving=recv, failed_recving=failed,
                                 extra={"pool": done, "pool_epoch": epoch})

    def shutdown(self) -> None:
        """Stop the threads and the lookup server; close an owned store client. Idempotent."""
        for part in (self.client, self.server, self.transfer):
            if part is not None:
                with contextlib.suppress(StoreError, OSError):
                    part.close()
        self.client = self.server = self.transfer = None
        self.handle.close()

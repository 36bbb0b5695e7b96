"""Shared bookkeeping of the asynchronous load/store connectors (``offload``, ``pool``).

Both follow one protocol: the scheduler side turns an admitted hit into a *load job* and newly
full blocks into *store jobs*, each pinning its device blocks until the worker reports the job
done; the worker side issues a step's jobs from the per-step metadata and reports completions in
``get_finished``. What is the same lives in two classes, one per side: :class:`JobScheduler` (the
job table, per-request state, the no-offer set: a request whose load failed recomputes and is never
offered again) and :class:`JobWorker` (the bound metadata, and the jobs of a metadata whose step
never issued them: they end, not ok, so every pin is released). They share the job protocol only:
the metadata (:class:`Meta`) one way, the completions under ``KVConnectorOutput.extra`` the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any

from hwkv.connectors.base.roles import ConnectorScheduler, ConnectorWorker
from hwkv.interfaces.connector import KVConnectorOutput


@dataclass
class ReqState:
    request: Any
    num_stored: int = 0  # units [0, num_stored) are stored, skipped or in flight
    hold: bool = False  # a load into its blocks is unconfirmed: store nothing (it may be garbage)


@dataclass
class Meta:
    """One step's jobs; a load entry is ``(job id, request id, ...)``, a store entry ``(job id, ...)``."""

    loads: list[tuple]
    stores: list[tuple]
    issued_loads: bool = False
    issued_stores: bool = False


class JobScheduler(ConnectorScheduler):
    """Subclasses set ``extra_key`` (their entry of ``KVConnectorOutput.extra``: completions as
    ``(job id, ok, *details)``) and implement ``_complete(job, ok, *details)``; their jobs have
    ``job_id``, ``load`` and ``req_id``."""

    extra_key = ""

    def __init__(self) -> None:
        self.kv: Any = None  # the device KVCacheManager
        self._reqs: dict[str, ReqState] = {}
        self._new_loads: list[Any] = []
        self._jobs: dict[int, Any] = {}  # issued or about to be, pins held
        self._storing: set[bytes] = set()  # hashes with a store in flight
        self._no_offer: set[str] = set()  # a load of theirs failed: recompute, never offer again
        self._ids = count()

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv = kv_cache_manager

    def _add_job(self, job: Any, blocks: list[Any]) -> Any:
        """Pin ``blocks`` (device) for the job's lifetime and track it; a load is issued next step."""
        self._pin(job, blocks)
        self._jobs[job.job_id] = job
        if job.load:
            self._new_loads.append(job)
            self._reqs[job.req_id].hold = True
        return job

    def _pin(self, job: Any, blocks: list[Any]) -> None:
        self.kv.block_pool.touch(blocks)

    def _take_loads(self, scheduler_output: Any) -> list[Any]:
        for rid in scheduler_output.preempted_req_ids:  # blocks gone; stores resume on re-admission
            self._reqs.pop(rid, None)
        loads, self._new_loads = self._new_loads, []
        return loads

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._no_offer |= {rid for rid in output.failed_recving if rid in self._reqs}  # finished: keep nothing
        for job_id, ok, *details in output.extra.get(self.extra_key, ()):
            job = self._jobs.pop(job_id, None)
            if job is not None:
                self._complete(job, ok, *details)

    def _complete(self, job: Any, ok: bool, *details: Any) -> None:
        raise NotImplementedError

    def _forget(self, rid: str) -> ReqState | None:
        self._no_offer.discard(rid)
        return self._reqs.pop(rid, None)

    def has_pending_transfers(self) -> bool:
        return bool(self._jobs)


class JobWorker(ConnectorWorker):
    """Subclasses set ``fail_details`` (the details of a job that never ran) and report their
    completions under their scheduler's ``extra_key``."""

    fail_details: tuple = ()

    def __init__(self) -> None:
        self.dev: Any = None
        self._meta: Meta | None = None
        self._failed_now: set[str] = set()
        self._unissued: list[tuple] = []  # jobs of a meta whose step never issued them

    def bind_device(self, device: Any) -> None:
        self.dev = device

    def bind_connector_metadata(self, metadata: Any) -> None:
        prev = self._meta
        if prev is not None:  # its step failed before issuing: those jobs end, not ok (pins released)
            if not prev.issued_loads:
                self._unissued += [(j, False, *self.fail_details) for j, *_ in prev.loads]
                self._failed_now |= {rid for _, rid, *_ in prev.loads}
            if not prev.issued_stores:  # never store KV of a step that did not run
                self._unissued += [(j, False, *self.fail_details) for j, *_ in prev.stores]
        self._meta = metadata

    def _issue(self, loads: bool) -> list[tuple]:
        """This step's loads (``start_load_kv``) or stores (``wait_for_save``), marked issued."""
        meta = self._meta
        if meta is None:
            return []
        if loads:
            meta.issued_loads = True
            return meta.loads
        meta.issued_stores = True
        return meta.stores

    def _take_done(self) -> tuple[list[tuple], set[str], set[str]]:
        """``get_finished``'s start: (done jobs, finished loads, failed loads) known before polling."""
        if self._meta is not None and self._meta.issued_loads and self._meta.issued_stores:
            self._meta = None
        done, self._unissued = self._unissued, []
        failed, self._failed_now = self._failed_now, set()
        return done, set(), failed

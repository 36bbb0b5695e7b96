"""The driver's merge of every rank's KV connector output (vLLM's ``KVOutputAggregator``).

At ``tensor_parallel_size > 1`` each rank's connector worker side moves only its own KV shard, so
one rank's report says nothing about the others':

* ``finished_sending`` — a request's blocks may be freed once every rank reported it sent (or,
  for a connector with ``tp_sending_from_driver``, once rank 0 did: its scheduler side tracks
  every rank's readers);
* ``finished_recving`` / ``failed_recving`` of an asynchronous load — reported once every rank
  reported the request (finished or failed), failed if any rank failed: until then another rank
  may still be writing into its blocks, which the scheduler frees on a failure;
* ``failed_recving`` of a synchronous load (the request ran in the step that reports it) — failed
  at once: every rank's synchronous load ended inside that step, and its token must be discarded
  in that very step;
* ``valid_tokens`` of a failed load — the smallest over the ranks that failed it (a rank whose
  load landed holds all its blocks; a failing rank that says nothing holds none);
* ``extra`` job completions (``connector.tp_job_keys``: entries ``(job id, ok, *details)``) —
  reported once every rank reported the job, ok only if every rank's was, details merged by
  ``connector.merge_tp_job`` (pins are released once no rank reads or writes the blocks);
* any other ``extra`` key — each rank's latest value, merged by ``connector.merge_tp_extra``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from hwkv.core.sched_output import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int, connector: Any):
        self.n, self.conn = world_size, connector
        self._sending: dict[str, int] = {}  # rid -> ranks that reported it sent
        self._recving: dict[str, tuple[int, bool]] = {}  # rid -> (ranks that reported the load, any failed)
        self._jobs: dict[tuple[str, Any], tuple[int, bool, list[Any]]] = {}  # (key, job) -> (ranks, ok, details)
        self._latest: dict[str, list[Any]] = {}  # other extra keys: key -> each rank's latest value
        self._valid: dict[str, int] = {}  # rid -> the smallest valid_tokens of the ranks that failed its load

    def pending(self) -> int:
        """Requests and jobs some rank has reported but not every rank yet."""
        return len(self._sending) + len(self._recving) + len(self._jobs)

    def aggregate(self, outputs: list[tuple[int, KVConnectorOutput | None]],
                  scheduled: Collection[str]) -> KVConnectorOutput | None:
        """Merge one step's reports (``(rank, output)``, any number per rank, older ones first);
        ``scheduled``: the requests the step ran (their failed loads are synchronous ones)."""
        sent: set[str] = set()
        recv: set[str] = set()
        failed: set[str] = set()
        extra: dict[str, Any] = {}
        changed: set[str] = set()
        jobs = set(self.conn.tp_job_keys)
        from_driver = self.conn.tp_sending_from_driver
        for rank, out in outputs:
            if out is None:
                continue
            if from_driver:
                sent |= out.finished_sending if rank == 0 else set()
            else:
                sent |= {rid for rid in out.finished_sending if self._count(self._sending, rid)}
            for rid in out.failed_recving:
                v = out.valid_tokens.get(rid, 0)
                self._valid[rid] = min(self._valid.get(rid, v), v)
                if rid in scheduled:
                    failed.add(rid)
                    self._recving.pop(rid, None)
                else:
                    self._load(rid, False, recv, failed)
            for rid in out.finished_recving:
                self._load(rid, True, recv, failed)
            for key, value in out.extra.items():
                if key in jobs:
                    for job_id, ok, *details in value:
                        done = self._job(key, job_id, bool(ok), list(details))
                        if done is not None:
                            extra.setdefault(key, []).append(done)
                else:
                    self._latest.setdefault(key, [None] * self.n)[rank] = value
                    changed.add(key)
        for key in sorted(changed):
            extra[key] = self.conn.merge_tp_extra(key, self._latest[key])
        for rid in recv - failed:
            self._valid.pop(rid, None)
        valid = {rid: v for rid in failed if (v := self._valid.pop(rid, 0))}
        if not (sent or recv or failed or extra):
            return None
        return KVConnectorOutput(finished_sending=sent, finished_recving=recv - failed, failed_recving=failed,
                                 extra=extra, valid_tokens=valid)

    def _count(self, table: dict[str, int], rid: str) -> bool:
        k = table.get(rid, 0) + 1
        if k < self.n:
            table[rid] = k
            return False
        table.pop(rid, None)
        return True

    def _load(self, rid: str, ok: bool, recv: set[str], failed: set[str]) -> None:
        k, bad = self._recving.get(rid, (0, False))
        k, bad = k + 1, bad or not ok
        if k < self.n:
            self._recving[rid] = (k, bad)
            return
        self._recving.pop(rid, None)
        (failed if bad else recv).add(rid)

    def _job(self, key: str, job_id: Any, ok: bool, details: list[Any]) -> tuple | None:
        prev = self._jobs.get((key, job_id))
        if prev is not None:
            k, was_ok, acc = prev
            ok, details, k = ok and was_ok, self.conn.merge_tp_job(key, acc, details), k + 1
        else:
            k = 1
        if k < self.n:
            self._jobs[(key, job_id)] = (k, ok, details)
            return None
        self._jobs.pop((key, job_id), None)
        return (job_id, ok, *details)

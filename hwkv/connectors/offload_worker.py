"""The offload connector's worker side: one step's loads and stores as copies on side streams.

Loads run on a load stream that first waits for the compute stream (a reused device block may
still be written by the previous forward); the compute stream waits for a synchronous load's event
before the forward. Stores of newly full blocks run on a store stream after an event recorded
behind the forward. A preempted request's store (its device blocks are already free and may be
reused by this very step) is issued first of all, before the loads, and the compute stream waits
for it: neither this step's loads nor its forward can overwrite those blocks before they are read.
Completion is polled with ``Event.query`` — never a host sync on the compute path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hwkv.connectors.copy import copy_block_pairs
from hwkv.connectors.jobs import JobConnector, Meta
from hwkv.core.sched_output import KVConnectorOutput


@dataclass
class OffloadMeta(Meta):
    """Loads ``(job, req, host ids, device ids, async)``; stores and ``early_stores`` (preempted
    requests', issued before the forward) ``(job, device ids, host ids)``."""

    early_stores: list[tuple] = field(default_factory=list)


@dataclass
class _Flight:
    job_id: int
    event: Any
    ok: bool
    req_id: str = ""
    is_async: bool = False
    t0: float = 0.0
    reported: bool = False


class OffloadWorker(JobConnector):
    """Worker half of :class:`~hwkv.connectors.offload.OffloadConnector`; completions go out as
    ``(job, ok)`` under ``extra["offload"]``."""

    _extra_key = "offload"
    metadata_type = OffloadMeta | None  # what tensor-parallel ranks decode (early stores included)
    min_run_blocks: int | None
    load_timeout_s: float | None

    def _init_worker(self) -> None:
        self.device_kv: Any = None
        self.host_kv: Any = None
        self._flights: list[_Flight] = []

    def bind_connector_metadata(self, metadata: Any) -> None:
        prev = self._meta
        if prev is not None and not prev.issued_loads:  # its step never ran: the early stores end, not ok
            self._unissued += [(j, False) for j, *_ in prev.early_stores]
        super().bind_connector_metadata(metadata)

    def load_blocks(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Queue one request's host → device copies on the load stream (tests inject failures here)."""
        copy_block_pairs(self.dev, self.host_kv, self.device_kv, host_ids, device_ids, self._load_stream,
                         self.min_run_blocks)

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is not None and meta.early_stores and not meta.issued_loads:
            ev = self._save(meta.early_stores)
            self.dev.current_stream().wait_event(ev)  # the forward may overwrite those freed blocks
            self._load_stream.wait_event(ev)  # and so may this step's loads
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
        if stores:
            self._save(stores)  # behind this step's forward: the blocks it fills are written

    def store_blocks(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Queue device → host copies on the store stream (tests inject failures here)."""
        copy_block_pairs(self.dev, self.device_kv, self.host_kv, device_ids, host_ids, self._store_stream,
                         self.min_run_blocks)

    def _save(self, stores: list[tuple]) -> Any:
        """One batched copy of ``stores`` (a launch per KV tensor, not per request) after the compute
        stream's work so far; returns its completion event."""
        dev, stream = self.dev, self._store_stream
        written = dev.new_event()
        written.record()
        stream.wait_event(written)
        try:
            self.store_blocks([b for _, d, _ in stores for b in d], [b for _, _, h in stores for b in h])
            ok = True
        except Exception:
            ok = False  # the tier just does not get these blocks
        ev = dev.new_event()
        ev.record(stream)
        self._flights += [_Flight(job_id, ev, ok) for job_id, _, _ in stores]
        return ev

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

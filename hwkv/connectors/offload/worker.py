"""The offload connector's worker side (:class:`OffloadWorker`): one step's loads and stores as copies
on side streams, between the device KV cache and its host mirror of ``HostTierGeometry.num_blocks``.

Loads run on a load stream that first waits for the compute stream (a reused device block may
still be written by the previous forward); the compute stream waits for a synchronous load's event
before the forward. Stores of newly full blocks run on a store stream after an event recorded
behind the forward. A preempted request's store (its device blocks are already free and may be
reused by this very step) is issued first of all, before the loads, and the compute stream waits
for it: neither this step's loads nor its forward can overwrite those blocks before they are read.
Completion is polled with ``Event.query`` — never a host sync on the compute path.

Layer by layer (``layerwise``: where the device has events a captured graph can wait on and the
KV layout keeps layers apart, i.e. not CROSS_LAYER): a step's synchronous loads are copied layer
after layer, an event recorded behind each layer's copies, and the forward waits for layer ``i``'s
event just before layer ``i``'s attention instead of for the whole load before it starts, so the
forward over the loaded context runs behind the copy (the step that computes the rest of the prompt
finishes one layer after the last layer's copy). Graphs captured without the per-layer hooks (the
engine's decode graphs, and its short-query graphs outside such a step) wait once, for the last
layer's event, before they replay (``wait_for_all_layer_loads``), and only in such a step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from hwkv.connectors.base.copy import CopyPlan, copy_block_pairs, plan_copy, run_copy
from hwkv.connectors.base.jobs import JobWorker, Meta
from hwkv.connectors.offload.tier import HostTierGeometry
from hwkv.interfaces.connector import KVConnectorOutput


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


class OffloadWorker(JobWorker):
    """Completions go out as ``(job, ok)`` under ``extra["offload"]``; ``load_blocks`` and
    ``store_blocks`` are where tests inject transfer failures."""

    def __init__(self, min_run_blocks: int | None, load_timeout_s: float | None, layerwise_load: bool) -> None:
        super().__init__()
        self.min_run_blocks, self.load_timeout_s, self.layerwise_load = min_run_blocks, load_timeout_s, layerwise_load
        self.device_kv: Any = None
        self.host_kv: Any = None
        self._load_stream: Any = None
        self._store_stream: Any = None
        self._flights: list[_Flight] = []
        self._layer_events: list[Any] | None = None  # layerwise: one per layer, recorded behind its copies
        self._layers: list[tuple[Any, Any]] = []  # (host, device) one-layer views of the caches
        self._plans: dict[tuple[int, int], tuple[list[int], list[int], CopyPlan]] = {}  # this step's, per load
        self._layered_now = False  # this step issued loads layer by layer
        self._pairs: list[tuple[Any, Any]] = []  # KV-cache groups: (host mirror, device cache) per group
        self._offsets: tuple[list[int], list[int]] = ([], [])  # groups: (device, host) flat id offsets
        self._layer_group: list[int] = []  # groups: each layer's group

    def register_kv_caches(self, kv_cache: Any, geometry: HostTierGeometry | None = None) -> None:
        """Allocate the host mirror of ``geometry.num_blocks`` blocks (the connector computes it from
        its ``cpu_bytes``) and the copy streams."""
        if geometry is None:
            raise ValueError("offload: the worker side needs the host tier's geometry")
        self.device_kv = kv_cache
        self._load_stream, self._store_stream = self.dev.new_stream(), self.dev.new_stream()
        caches = getattr(kv_cache, "caches", None)  # KV-cache groups: a mirror per group, ids flat over them
        if caches is not None:
            self._pairs = [(self._mirror(c, geometry), c) for c in caches]
            self._offsets = ([sum(c.spec.num_blocks for c in caches[:g]) for g in range(len(caches))],
                             [g * geometry.num_blocks for g in range(len(caches))])
            self.host_kv = [h for h, _ in self._pairs]
            # layer i's blocks are in its group's tensors: its views, and its group's share of a load
            self._layer_group = kv_cache.layer_group
            where = kv_cache.where
            self._init_layers(self.layerwise_load, [(self.host_kv[g].layer_cache(j), caches[g].layer_cache(j))
                                                    for g, j in (where[i] for i in range(kv_cache.spec.num_layers))])
            return
        self.host_kv = self._mirror(kv_cache, geometry)
        self._init_layers(self.layerwise_load)

    def _mirror(self, kv_cache: Any, geometry: HostTierGeometry) -> Any:
        host = self.dev.allocate_kv_cache(replace(kv_cache.spec, num_blocks=geometry.num_blocks), kv_cache.layout,
                                          host=True)
        host.scales = kv_cache.scales  # fp8 KV: the mirror's codes mean what the device's do
        return host

    def _by_group(self, host_ids: list[int], device_ids: list[int]) -> list[tuple[int, Any, Any, list[int], list[int]]]:
        """Flat ids (the scheduler's: ``offset[g] + id``) as ``(group, host cache, device cache, host ids,
        device ids)`` per group with blocks."""
        dev_off, host_off = self._offsets
        out = []
        for g, (host, dev) in enumerate(self._pairs):
            sel = [i for i, d in enumerate(device_ids) if dev_off[g] <= d < dev_off[g] + dev.spec.num_blocks]
            if sel:
                out.append((g, host, dev, [host_ids[i] - host_off[g] for i in sel],
                            [device_ids[i] - dev_off[g] for i in sel]))
        return out

    def stats(self) -> dict[str, Any]:
        return {"layerwise": bool(self.layerwise)}

    def _init_layers(self, want: bool, views: list[tuple[Any, Any]] | None = None) -> None:
        """Layer-by-layer loads where wanted and possible (see the module doc); else whole loads.
        ``views``: each layer's ``(host, device)`` one-layer caches (KV-cache groups: its group's)."""
        n = self.device_kv.spec.num_layers
        if views is None:
            views = [(self.host_kv.layer_cache(i), self.device_kv.layer_cache(i)) for i in range(n)]
        if not want or views[0][0] is None:  # off, or a layout whose layers are not separate ranges
            self.layerwise = False
            return
        events = [self.dev.graph_event() for _ in range(n)]
        self.layerwise = all(e is not None for e in events)
        if self.layerwise:
            self._layer_events, self._layers = events, views

    def bind_connector_metadata(self, metadata: Any) -> None:
        prev = self._meta
        if prev is not None and not prev.issued_loads:  # its step never ran: the early stores end, not ok
            self._unissued += [(j, False) for j, *_ in prev.early_stores]  # type: ignore[attr-defined]
        super().bind_connector_metadata(metadata)

    def load_blocks(self, host_ids: list[int], device_ids: list[int], layer: int | None = None) -> None:
        """Queue one request's host → device copies (of one ``layer``, or all) on the load stream
        (tests inject failures here)."""
        if self._pairs:
            if layer is None:
                for _, host, dev, h, d in self._by_group(host_ids, device_ids):
                    run_copy(self.dev, host, dev, plan_copy(host, dev, h, d, self.min_run_blocks), self._load_stream)
                return
            key = (id(host_ids), id(device_ids))  # split and planned once per group for all layers
            entry = self._plans.get(key)
            if entry is None or entry[0] is not host_ids or entry[1] is not device_ids:
                plans = {g: plan_copy(host, dev, h, d, self.min_run_blocks)
                         for g, host, dev, h, d in self._by_group(host_ids, device_ids)}
                entry = self._plans[key] = (host_ids, device_ids, plans)  # type: ignore[assignment]
            plan = entry[2].get(self._layer_group[layer])  # type: ignore[union-attr]
            if plan is not None:  # a load without blocks of this layer's group copies nothing for it
                host, device = self._layers[layer]
                run_copy(self.dev, host, device, plan, self._load_stream)
            return
        if layer is None:
            plan = plan_copy(self.host_kv, self.device_kv, host_ids, device_ids, self.min_run_blocks)
            run_copy(self.dev, self.host_kv, self.device_kv, plan, self._load_stream)
            return
        # planned once for all layers; the memo holds the lists, so their ids cannot be reused meanwhile
        key = (id(host_ids), id(device_ids))
        entry = self._plans.get(key)
        if entry is None or entry[0] is not host_ids or entry[1] is not device_ids:
            plan = plan_copy(self.host_kv, self.device_kv, host_ids, device_ids, self.min_run_blocks)
            entry = self._plans[key] = (host_ids, device_ids, plan)
        host, device = self._layers[layer]
        run_copy(self.dev, host, device, entry[2], self._load_stream)

    def _try_load(self, rid: str, host_ids: list[int], device_ids: list[int], layer: int | None = None) -> bool:
        try:
            self.load_blocks(host_ids, device_ids, layer)
            return True
        except Exception:  # reported, then recomputed: never wrong tokens
            self._failed_now.add(rid)
            return False

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is not None and meta.early_stores and not meta.issued_loads:
            ev = self._save(meta.early_stores)
            self.dev.current_stream().wait_event(ev)  # the forward may overwrite those freed blocks
            self._load_stream.wait_event(ev)  # and so may this step's loads
        self._layered_now = False
        loads = self._issue(loads=True)
        if not loads:
            return
        self._plans.clear()  # one step's plans: never carried into the next
        dev, stream = self.dev, self._load_stream
        ready = dev.new_event()
        ready.record()  # the compute stream's work so far: a reused block's last writer
        stream.wait_event(ready)
        # synchronous loads first (the forward waits for them), then the asynchronous ones
        loads = sorted(loads, key=lambda job: job[4])
        ok: dict[int, bool] = {}
        layered = self._layer_events is not None and not loads[0][4]
        if layered:  # wait_for_layer_load(i) waits for layer i's event only
            for i, layer_ev in enumerate(self._layer_events):  # type: ignore[arg-type]
                for job_id, rid, host_ids, device_ids, is_async in loads:
                    if not is_async and ok.get(job_id, True):
                        ok[job_id] = self._try_load(rid, host_ids, device_ids, i)
                layer_ev.record(stream)
        last_sync = None
        for job_id, rid, host_ids, device_ids, is_async in loads:
            if job_id not in ok:
                ok[job_id] = self._try_load(rid, host_ids, device_ids)
            ev = dev.new_event()
            ev.record(stream)
            self._flights.append(_Flight(job_id, ev, ok[job_id], rid, is_async, time.monotonic(),
                                         reported=not ok[job_id]))
            if ok[job_id] and not is_async:
                last_sync = ev
        self._plans.clear()
        self._layered_now = layered
        if last_sync is not None and not layered:
            dev.current_stream().wait_event(last_sync)  # the forward reads the loaded blocks

    def wait_for_layer_load(self, layer: int) -> None:
        # every forward waits (also a graph's, captured once): a layer whose loads ended long ago costs a no-op wait
        self.dev.current_stream().wait_event(self._layer_events[layer])  # type: ignore[index]

    def wait_for_all_layer_loads(self) -> None:
        # the layers' events are recorded in order on one stream: the last one covers them all
        if self._layered_now:
            self.dev.current_stream().wait_event(self._layer_events[-1])  # type: ignore[index]

    def loads_layer_by_layer(self) -> bool:
        return self._layered_now

    def wait_for_save(self) -> None:
        stores = self._issue(loads=False)
        if stores:
            self._save(stores)  # behind this step's forward: the blocks it fills are written

    def store_blocks(self, device_ids: list[int], host_ids: list[int]) -> None:
        """Queue device → host copies on the store stream (tests inject failures here)."""
        if self._pairs:
            for _, host, dev, h, d in self._by_group(host_ids, device_ids):
                copy_block_pairs(self.dev, dev, host, d, h, self._store_stream, self.min_run_blocks)
            return
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

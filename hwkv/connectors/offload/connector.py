"""CPU offload connector: a host-memory tier of KV blocks behind the device prefix cache (the
protocol of vLLM's CPU offload connector; docs/connectors.md maps it step by step).

:class:`OffloadConnector` is the configuration and the two sides:
:class:`~hwkv.connectors.offload.scheduler.OffloadScheduler` (the tier's index, jobs, pins) and
:class:`~hwkv.connectors.offload.worker.OffloadWorker` (host mirror, streams, copies); the one thing
they share is the tier's :class:`~hwkv.connectors.offload.tier.HostTierGeometry`.

Failures: a load that cannot be issued is reported in ``failed_recving`` in the same step (the
scheduler discards that step's token and recomputes); the request is never offered the tier again.
An asynchronous load (``async_load=True``) still running after ``load_timeout_s`` is reported
failed too; its blocks stay pinned until the copy ends, so nothing is reused under it.
"""

from __future__ import annotations

from typing import Any

from hwkv.connectors.base.roles import SplitConnector
from hwkv.connectors.offload.scheduler import OffloadScheduler
from hwkv.connectors.offload.tier import HostTierGeometry
from hwkv.connectors.offload.worker import OffloadMeta, OffloadWorker


class OffloadConnector(SplitConnector):
    """``kv_connector="offload"``; ``worker_cls`` is the worker side's class (tests inject failures
    with a subclass)."""

    name = "offload"
    capturable_layer_hooks = True  # wait_for_layer_load only queues a wait on an event
    layer_hooks_only_when_loading = True  # other steps' graphs: one wait for the last layer, not one per layer
    # tensor parallelism: every rank runs its jobs over its own KV shard; the metadata is plain data
    supports_tensor_parallel = True
    supports_kv_groups = True  # a host tier per KV-cache group (docs/hybrid-models.md)
    metadata_type = OffloadMeta | None  # what tensor-parallel ranks decode (early stores included)
    tp_job_keys = (OffloadScheduler.extra_key,)
    worker_cls: type[OffloadWorker] = OffloadWorker
    scheduler: OffloadScheduler
    worker: OffloadWorker

    def __init__(self, cpu_bytes: int, min_run_blocks: int | None = None, store: bool = True, async_load: bool = False,
                 load_timeout_s: float | None = None, store_batch_blocks: int = 32, layerwise_load: bool = True):
        if not isinstance(cpu_bytes, int) or isinstance(cpu_bytes, bool) or cpu_bytes <= 0:
            raise ValueError(f"offload: cpu_bytes must be a positive int (bytes of host memory), got {cpu_bytes!r}")
        if min_run_blocks is not None and (not isinstance(min_run_blocks, int) or isinstance(min_run_blocks, bool)
                                           or min_run_blocks < 1):
            raise ValueError(f"offload: min_run_blocks must be an int >= 1 or None (automatic), got {min_run_blocks!r}")
        if not isinstance(store_batch_blocks, int) or isinstance(store_batch_blocks, bool) or store_batch_blocks < 1:
            raise ValueError(f"offload: store_batch_blocks must be an int >= 1, got {store_batch_blocks!r}")
        if load_timeout_s is not None and not (isinstance(load_timeout_s, (int, float)) and load_timeout_s > 0):
            raise ValueError(f"offload: load_timeout_s must be > 0 seconds or None, got {load_timeout_s!r}")
        self.cpu_bytes, self.min_run_blocks = cpu_bytes, min_run_blocks
        self.store, self.async_load, self.load_timeout_s = bool(store), bool(async_load), load_timeout_s
        self.store_batch_blocks = store_batch_blocks
        if not isinstance(layerwise_load, bool):
            raise ValueError(f"offload: layerwise_load must be a bool, got {layerwise_load!r}")
        self.layerwise_load = layerwise_load
        self.scheduler = OffloadScheduler(self.store, self.async_load, store_batch_blocks)
        self.worker = self.worker_cls(min_run_blocks, load_timeout_s, layerwise_load)

    def register_kv_caches(self, kv_cache: Any) -> None:
        geometry = HostTierGeometry.of(kv_cache.spec, self.cpu_bytes)
        self.worker.register_kv_caches(kv_cache, geometry)
        groups = getattr(kv_cache, "groups", None)  # hwkv.engine.kv_groups.GroupedKVCache
        self.scheduler.bind_geometry(geometry, [len(g.layers) for g in groups] if groups else None)

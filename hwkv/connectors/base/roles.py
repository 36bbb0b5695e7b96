"""A connector's two roles as two classes (vLLM v1's ``KVConnectorRole.SCHEDULER`` / ``WORKER``).

:class:`ConnectorScheduler` holds the hooks the scheduler calls and the state they keep (lookups,
jobs, pins of device blocks); :class:`ConnectorWorker` the hooks the model runner calls and its
state (streams, events, transfers in flight). Neither reads the other's attributes: what both need
(a geometry, a configuration) is a small typed object handed to each. :class:`SplitConnector` is
the :class:`~hwkv.interfaces.connector.KVConnectorBase` the engine sees: it owns one side of each
and forwards every hook to the side that owns it; a connector package subclasses it to construct
its sides from its configuration and to hand them what they share (``register_kv_caches``,
``bind_model``, ...). At tensor parallelism every rank builds the whole connector; only the
driver's scheduler side is ever called.

The contract of each hook is on :class:`~hwkv.interfaces.connector.KVConnectorBase`.
"""

from __future__ import annotations

from typing import Any

from hwkv.interfaces.connector import KVConnectorBase, KVConnectorOutput


class ConnectorScheduler:
    """The scheduler side: every hook does nothing until overridden."""

    tp_size: int = 1

    def bind_tp(self, rank: int, size: int) -> None:
        self.tp_size = size

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None: ...

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None: ...

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_preempted(self, request: Any) -> None: ...

    def has_pending_transfers(self) -> bool:
        return False

    def bind_tp_worker_info(self, infos: list[Any]) -> None: ...

    def merge_tp_job(self, key: str, a: list[Any], b: list[Any]) -> list[Any]:
        return [x + y for x, y in zip(a, b)]

    def enable_kv_events(self) -> None: ...

    def take_kv_events(self) -> list[Any]:
        return []

    def kv_event_snapshot(self) -> list[Any]:
        return []

    def merge_tp_extra(self, key: str, values: list[Any]) -> Any:
        return next(v for v in values if v is not None)

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None: ...


class ConnectorWorker:
    """The worker side (one per tensor-parallel rank): every hook does nothing until overridden."""

    layerwise: bool = False  # see KVConnectorBase.layerwise: decided by the worker, in register_kv_caches
    tp_rank: int = 0
    tp_size: int = 1

    def bind_tp(self, rank: int, size: int) -> None:
        self.tp_rank, self.tp_size = rank, size

    def bind_device(self, device: Any) -> None: ...

    def register_kv_caches(self, kv_cache: Any) -> None: ...

    def bind_connector_metadata(self, metadata: Any) -> None: ...

    def start_load_kv(self) -> None: ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def wait_for_all_layer_loads(self) -> None: ...

    def loads_layer_by_layer(self) -> bool:
        return False

    def save_kv_layer(self, layer: int, layer_kv: Any, attn_metadata: Any) -> None: ...

    def wait_for_save(self) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        return None

    def tp_worker_info(self) -> Any:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None: ...


class SplitConnector(KVConnectorBase):
    """A connector made of one :class:`ConnectorScheduler` and one :class:`ConnectorWorker`, built by the
    subclass's ``__init__``; this class only forwards (and owns no state of either side)."""

    scheduler: ConnectorScheduler
    worker: ConnectorWorker

    @property  # type: ignore[override]
    def layerwise(self) -> bool:
        return self.worker.layerwise

    def bind_tp(self, rank: int, size: int) -> None:
        super().bind_tp(rank, size)
        self.scheduler.bind_tp(rank, size)
        self.worker.bind_tp(rank, size)

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def stats(self) -> dict[str, Any]:
        return {**self.scheduler.stats(), **self.worker.stats()}

    # ---- scheduler side ------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_preempted(self, request: Any) -> None:
        self.scheduler.request_preempted(request)

    def has_pending_transfers(self) -> bool:
        return self.scheduler.has_pending_transfers()

    def bind_tp_worker_info(self, infos: list[Any]) -> None:
        self.scheduler.bind_tp_worker_info(infos)

    def merge_tp_job(self, key: str, a: list[Any], b: list[Any]) -> list[Any]:
        return self.scheduler.merge_tp_job(key, a, b)

    def merge_tp_extra(self, key: str, values: list[Any]) -> Any:
        return self.scheduler.merge_tp_extra(key, values)

    def enable_kv_events(self) -> None:
        self.scheduler.enable_kv_events()

    def take_kv_events(self) -> list[Any]:
        return self.scheduler.take_kv_events()

    def kv_event_snapshot(self) -> list[Any]:
        return self.scheduler.kv_event_snapshot()

    # ---- worker side ---------------------------------------------------------------------------
    def bind_device(self, device: Any) -> None:
        self.worker.bind_device(device)

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.worker.register_kv_caches(kv_cache)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.worker.bind_connector_metadata(metadata)

    def start_load_kv(self) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def wait_for_all_layer_loads(self) -> None:
        self.worker.wait_for_all_layer_loads()

    def loads_layer_by_layer(self) -> bool:
        return self.worker.loads_layer_by_layer()

    def save_kv_layer(self, layer: int, layer_kv: Any, attn_metadata: Any) -> None:
        self.worker.save_kv_layer(layer, layer_kv, attn_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        return self.worker.get_finished(finished_req_ids)

    def tp_worker_info(self) -> Any:
        return self.worker.tp_worker_info()

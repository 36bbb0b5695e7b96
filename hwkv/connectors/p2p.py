"""Prefill/decode disaggregation: the ``p2p`` connector moves a prompt's KV from a prefill engine
(``role="producer"``) to a decode engine (``role="consumer"``) over a :class:`~hwkv.interfaces.transfer.Transfer`
(Mooncake TransferEngine), in one of two modes (docs/disaggregation.md walks through both):

* ``mode="pull"`` (vllm-ascend's Mooncake connector): the producer keeps the prompt's blocks after
  prefill (``delay_free``) and returns where they are in ``kv_transfer_params``; the consumer
  allocates blocks, READs the producer's into them, and tells the producer to free its copy.
* ``mode="push"`` (vLLM's Mooncake connector): the consumer allocates blocks and sends their ids to
  the producer, which WRITEs its blocks into them and notifies the consumer.

Both sides pin the blocks a transfer touches until it has really ended (a consumer whose load
timed out recomputes, but its blocks stay pinned until the transfer stops). Every wait is bounded:
a dead peer becomes a failed load (the consumer recomputes: identical tokens) or an expired hold
(the producer frees the blocks after ``hold_timeout_s``).

Tensor parallelism (docs/disaggregation.md): the scheduler side and the side channel run on the
driver; every rank registers its KV shard with its own transfer engine and reports its layout
(``tp_worker_info``), so the producer's handshake reply lists every rank's. Each consumer rank
gets the head slices :func:`~hwkv.connectors.p2p_protocol.read_plan` gives it (producer and
consumer may differ in tp where one size divides the other): it reads them (pull), or the producer
ranks holding them write them (push, :mod:`hwkv.connectors.p2p_push`); the producer frees a
request's blocks once every consumer rank was served.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hwkv.connectors.copy import copy_block_pairs
from hwkv.connectors.p2p_channel import SideChannel
from hwkv.connectors.p2p_consumer import ConsumerSide, LoadSpec
from hwkv.connectors.p2p_producer import ProducerSide
from hwkv.connectors.p2p_protocol import (
    Ack,
    Acquire,
    Hello,
    HelloReply,
    Layout,
    PushDone,
    PushOrder,
    PushPart,
    PushRequest,
    Release,
    incompatibility,
    layout_of,
)
from hwkv.connectors.p2p_push import PushSide
from hwkv.core.sched_output import KVConnectorOutput
from hwkv.interfaces.connector import KVConnectorBase

ROLES, MODES = ("producer", "consumer"), ("pull", "push")


class P2PConnector(PushSide, ProducerSide, ConsumerSide, KVConnectorBase):
    name = "p2p"

    def __init__(self, role: str, mode: str = "pull", host: str = "127.0.0.1", side_channel_port: int = 0,
                 protocol: str = "auto", metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
                 transfer_timeout_s: float = 10.0, hold_timeout_s: float = 60.0, staging: bool | None = None,
                 layerwise: bool = False):
        if role not in ROLES:
            raise ValueError(f"p2p: role={role!r} is invalid (allowed: {', '.join(ROLES)})")
        if mode not in MODES:
            raise ValueError(f"p2p: mode={mode!r} is invalid (allowed: {', '.join(MODES)})")
        if isinstance(side_channel_port, bool) or not isinstance(side_channel_port, int) \
                or not 0 <= side_channel_port < 65536:
            raise ValueError(f"p2p: side_channel_port={side_channel_port!r} is invalid (allowed: 0..65535, 0 = any)")
        for key, v in (("transfer_timeout_s", transfer_timeout_s), ("hold_timeout_s", hold_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise ValueError(f"p2p: {key}={v!r} is invalid (allowed: seconds in (0, 3600])")
        if layerwise and (role, mode) != ("producer", "push"):
            raise ValueError(f"p2p: layerwise=True applies to a producer in mode 'push' (got role={role!r}, "
                             f"mode={mode!r}; allowed: layerwise=False elsewhere)")
        self.layerwise = bool(layerwise)  # per-layer writes as the forward produces them (save_kv_layer)
        self.role, self.mode, self.host, self.port = role, mode, host, side_channel_port
        self.protocol, self.metadata_server, self.device_name = protocol, metadata_server, device_name
        self.transfer_timeout_s, self.hold_timeout_s = float(transfer_timeout_s), float(hold_timeout_s)
        self.staging = staging
        self._backend_protocols: tuple[str, ...] | None = None
        self._backend_reason = ""
        self.dev: Any = None
        self.host_kv: Any = None  # staging: pinned host mirror of the device KV (same block ids)
        self.engine_id = uuid.uuid4().hex[:16]
        self.kv: Any = None
        self.layout: Layout | None = None
        self.transfer: Any = None
        self.channel: SideChannel | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="p2p-transfer")
        self._lock = threading.Lock()
        # (kind "recv" | "sent", rid, ok, nbytes, settled): completions from the side channel and transfer threads
        self._results: queue.Queue[tuple[str, str, bool, int, bool]] = queue.Queue()
        self._wake = threading.Event()
        self._peers: dict[str, Layout] = {}  # consumer engine id -> its handshaken layout (push)
        self._producers: dict[str, list[Layout]] = {}  # producer side-channel address -> its ranks' layouts
        self.rank_layouts: list[Layout] = []  # every tensor-parallel rank's layout (scheduler side)
        self.total_kv_heads: int | None = None  # the model's (bind_model)
        # consumer
        self._offers: dict[str, tuple[int, int]] = {}  # rid -> (start, end) offered
        self._loads: dict[str, Any] = {}  # scheduler side: rid -> its pinned blocks, until every rank settled
        self._new_loads: list[Any] = []
        self._no_offer: set[str] = set()
        self._reading: dict[str, Any] = {}  # worker side: rid -> load into this rank's shard
        # producer (_held, _targets and _target_deadlines are shared with the side-channel thread: _lock)
        self._held: dict[str, Any] = {}
        self._targets: dict[str, tuple[PushRequest, Layout]] = {}  # transfer id -> consumer-first announcement
        self._target_deadlines: dict[str, float] = {}
        self._producing: dict[str, Any] = {}  # rid -> request carrying a transfer_id, until it finishes
        self._by_transfer: dict[str, str] = {}  # transfer id -> rid
        self._streams: dict[str, Any] = {}  # rid -> layerwise push in flight
        self._parts: dict[str, Any] = {}  # push in progress per consumer rank: its producer ranks' parts
        self._to_stage: list[tuple[str, list[int]]] = []  # tp staging: holds the ranks copy next step
        self._staged: list[tuple[str, bool]] = []  # worker side: holds this rank staged
        self._writes: list[Any] = []  # this step's layer writes
        self._idle = False
        self.counters = dict(loaded_bytes=0, stored_bytes=0, transfers=0, failed_transfers=0,
                             expired_holds=0, refused_offers=0, layer_writes=0,
                             transfer_s=0.0)  # seconds in blocking transfers (pull reads, push writes)

    # tensor parallelism: the scheduler side and the side channel run on the driver, which knows every
    # rank's layout; each consumer rank gets its heads itself, and the producer frees a request's
    # blocks once every consumer rank was served
    supports_tensor_parallel = True
    metadata_type = tuple[list[LoadSpec], list, bool, list[tuple[str, list[int]]]] | None
    # a load's blocks are unpinned once no rank's transfer can write them; a staged hold is served
    # once every rank staged its shard
    tp_job_keys = ("p2p_settled", "p2p_staged")
    tp_sending_from_driver = True
    tp_worker_info_type = Layout

    # ---- set-up --------------------------------------------------------------------------------
    def bind_model(self, model: str, model_config: Any = None) -> None:
        self.total_kv_heads = getattr(model_config, "num_kv_heads", None)

    def check_tensor_parallel(self, size: int) -> None:
        if self.layerwise:
            raise ValueError(f"p2p: layerwise=True needs tensor_parallel_size=1 (got {size}; allowed at "
                             "tensor_parallel_size > 1: layerwise=False, mode 'pull' or 'push')")

    def tp_worker_info(self) -> Any:
        return self.layout

    def bind_tp_worker_info(self, infos: list[Any]) -> None:
        self.rank_layouts = list(infos)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv = kv_cache_manager

    def bind_backend(self, backend: Any) -> None:
        caps = backend.capabilities
        self._backend_protocols, self._backend_reason = tuple(caps.transfer_protocols), caps.transfer_reason

    def bind_device(self, device: Any) -> None:
        self.dev = device

    def _resolve_protocol(self, on_host: bool) -> str:
        declared = self._backend_protocols
        if self.protocol != "auto":
            if declared and self.protocol not in declared and not (self.protocol == "tcp" and on_host):
                raise ValueError(f"p2p: protocol {self.protocol!r} is not offered by the backend (allowed: "
                                 f"{', '.join(declared)}, or 'auto')")
            return self.protocol
        if declared:  # the backend's preference: rdma/ascend where its devices register memory directly
            return declared[0]
        if on_host:
            return "tcp"
        raise ValueError(f"p2p: the backend declares no transfer protocol ({self._backend_reason or 'none'})")

    def register_kv_caches(self, kv_cache: Any) -> None:
        from hwkv.transfer.mooncake import MooncakeTransfer

        on_host = kv_cache.device.type == "cpu"
        self.protocol = self._resolve_protocol(on_host)
        staging = (not on_host and self.protocol == "tcp") if self.staging is None else bool(self.staging)
        if not on_host and self.protocol == "tcp" and not staging:
            raise ValueError(f"p2p: protocol 'tcp' moves host memory but the KV cache is on {kv_cache.device} "
                             "(allowed: staging=True or None, or protocol 'rdma' / 'ascend' for device memory)")
        self.kv_cache = kv_cache
        if staging:  # tcp from a device: through a pinned host mirror of the pool (same block ids)
            self.host_kv = self.dev.allocate_kv_cache(kv_cache.spec, kv_cache.layout, host=True)
        if staging and self.layerwise:
            raise ValueError("p2p: layerwise=True needs KV the transfer engine reaches directly (host memory, or "
                             "rdma/ascend device memory), not tcp staging (allowed: layerwise=False)")
        if self.tp_size > 1:
            self.check_tensor_parallel(self.tp_size)
        xfer = self.host_kv if staging else kv_cache
        self.transfer = MooncakeTransfer(protocol=self.protocol, host=self.host, metadata_server=self.metadata_server,
                                         device_name=self.device_name, timeout_s=self.transfer_timeout_s)
        for t in xfer.tensors:
            self.transfer.register(t.data_ptr(), t.numel() * t.element_size())
        # the driver's; in push mode every rank's too (a producer rank takes write orders, a consumer
        # rank its PushDone); in pull mode the other ranks only read (consumer) or are read (producer)
        if self.tp_rank == 0 or self.mode == "push":
            self.channel = SideChannel(self.host, self.port if self.tp_rank == 0 else 0, self._handle)
        self.layout = layout_of(xfer, self.engine_id, self.transfer.endpoint(), self.protocol,
                                tp_rank=self.tp_rank, tp_size=self.tp_size, total_kv_heads=self.total_kv_heads,
                                side_channel=self.channel.address if self.channel is not None else "")
        self.rank_layouts = [self.layout]  # the driver learns the other ranks' in bind_tp_worker_info

    def _stage(self, to_host: bool, block_ids: list[int]) -> None:
        """Staging: copy ``block_ids`` between the device pool and its host mirror, and wait for it."""
        src, dst = (self.kv_cache, self.host_kv) if to_host else (self.host_kv, self.kv_cache)
        stream = self.dev.current_stream()  # behind the forwards that wrote (or will read) the blocks
        copy_block_pairs(self.dev, src, dst, block_ids, block_ids, stream)
        ev = self.dev.new_event()
        ev.record(stream)
        ev.synchronize()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None

    # ---- side channel (its own thread) ---------------------------------------------------------
    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, Hello):
            why = incompatibility(self.layout, msg.layout)  # type: ignore[arg-type]
            if not why and msg.layout.tp_size != self.tp_size and self.layerwise:
                why = (f"layerwise push needs equal tensor-parallel sizes (tp={self.tp_size} here, tp="
                       f"{msg.layout.tp_size} at engine {msg.layout.engine_id}; allowed: layerwise=False)")
            if why:
                return HelloReply(None, why)
            with self._lock:
                self._peers[msg.layout.engine_id] = msg.layout
            return HelloReply(self.layout, layouts=self.rank_layouts)
        if isinstance(msg, Acquire):
            return self.accept_acquire(msg)
        if isinstance(msg, Release):
            return self.accept_release(msg)
        if isinstance(msg, PushRequest):
            return self.accept_push(msg)
        if isinstance(msg, PushOrder):
            return self.accept_order(msg)
        if isinstance(msg, PushPart):
            return self._part_done(msg)
        if isinstance(msg, PushDone):
            self._done("recv", msg.request_id, msg.ok, msg.nbytes, msg.settled)
            return Ack(True)
        return Ack(False, f"unexpected message {type(msg).__name__}")

    def _done(self, kind: str, rid: str, ok: bool, nbytes: int, settled: bool = True) -> None:
        self._results.put((kind, rid, ok, nbytes, settled))
        self._wake.set()

    # ---- scheduler side ------------------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if self.role == "consumer":
            self.consumer_admitted(request, num_external_tokens)
        elif self.layerwise:
            self.producer_admitted(request)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid, params = request.request_id, request.kv_transfer_params or {}
        self._offers.pop(rid, None)
        offered = rid in self._no_offer
        self._no_offer.discard(rid)
        if self.role == "consumer":
            if params.get("do_remote_prefill"):
                request.kv_transfer_params = None  # consumed: the response carries none (as vLLM's decode side)
                if not offered:  # finished (aborted) before it was admitted: nobody fetches the remote KV
                    self.release_remote(params)
            return False, None  # in-flight loads pin their blocks themselves
        if not params.get("do_remote_decode") or self.layout is None:
            return False, None
        return self.producer_finished(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads, self._new_loads = self._new_loads, []
        writes = self.layer_writes(scheduler_output) if self._producing else []
        stage, self._to_stage = self._to_stage, []
        return loads, writes, scheduler_output.total_num_scheduled_tokens == 0, stage

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if "p2p_staged" in output.extra:
            self.staged_holds(output.extra["p2p_staged"])
        for rid, *_ in output.extra.get("p2p_settled", ()):  # every rank's transfers into them ended
            blocks = self._loads.pop(rid, None)
            if blocks is not None:
                self.kv.block_pool.free_blocks(blocks)

    def has_pending_transfers(self) -> bool:
        return bool(self._loads or self._held or self._streams)

    def stats(self) -> dict[str, Any]:
        return dict(self.counters, loads_in_flight=len(self._loads), held_requests=len(self._held),
                    role=self.role, mode=self.mode)

    # ---- worker side ---------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        loads, self._writes, self._idle, stage = metadata if metadata is not None else ([], [], False, [])
        for rid, ids in stage:  # a tensor-parallel producer's held request: this rank's shard to its host mirror
            try:
                self._stage(True, ids)
                self._staged.append((rid, True))
            except Exception:
                self._staged.append((rid, False))
        if loads:
            self.start_loads(loads)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        if self._idle and self._results.empty():
            self._wake.wait(0.002)  # nothing scheduled: wait for the side channel instead of spinning
        self._wake.clear()
        recv: set[str] = set()
        failed: set[str] = set()
        sent: set[str] = set()
        while True:
            try:
                kind, rid, ok, nbytes, settled = self._results.get_nowait()
            except queue.Empty:
                break
            self.counters["transfers" if ok else "failed_transfers"] += 1
            if kind == "recv":
                self.consumer_result(rid, ok, nbytes, settled, recv, failed)
                continue
            with self._lock:
                if self._held.pop(rid, None) is not None:
                    sent.add(rid)
                    self.counters["stored_bytes"] += nbytes
        now, settled = time.monotonic(), []
        self.consumer_poll(now, failed, settled)
        self.producer_poll(now, sent)
        staged, self._staged = self._staged, []
        if not (recv or failed or sent or settled or staged):
            return None
        extra = {k: v for k, v in (("p2p_settled", settled), ("p2p_staged", staged)) if v}
        return KVConnectorOutput(finished_sending=sent, finished_recving=recv, failed_recving=failed, extra=extra)


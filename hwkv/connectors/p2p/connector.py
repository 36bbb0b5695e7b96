"""Prefill/decode disaggregation: the ``p2p`` connector moves a prompt's KV from a prefill engine
(``role="producer"``) to a decode engine (``role="consumer"``) over a :class:`~hwkv.interfaces.transfer.Transfer`
(the first protocol both offer that works between them: device-direct ``cuda_ipc`` on one host,
Mooncake ``rdma`` across hosts, ``tcp`` staging anywhere), in one of two modes
(docs/disaggregation.md walks through both):

* ``mode="pull"`` (vllm-ascend's Mooncake connector): the producer keeps the prompt's blocks after
  prefill (``delay_free``) and returns where they are in ``kv_transfer_params``; the consumer
  allocates blocks, READs the producer's into them, and tells the producer to free its copy.
* ``mode="push"`` (vLLM's Mooncake connector): the consumer allocates blocks and sends their ids to
  the producer, which WRITEs its blocks into them and notifies the consumer.

Both sides pin the blocks a transfer touches until it has really ended (a consumer whose load
timed out recomputes, but its blocks stay pinned until the transfer stops). Every wait is bounded:
a dead peer becomes a failed load (the consumer recomputes: identical tokens) or an expired hold
(the producer frees the blocks after ``hold_timeout_s``).

Transport (the protocols offered and chosen at the handshake, transfer endpoints, tcp staging,
side-channel dispatch):
:mod:`hwkv.connectors.p2p.transport`.

Tensor parallelism (docs/disaggregation.md): the scheduler side and the side channel run on the
driver; every rank registers its KV shard with its own transfer engine and reports its layout
(``tp_worker_info``), so the producer's handshake reply lists every rank's. Each consumer rank
gets the head slices :func:`~hwkv.connectors.p2p.protocol.read_plan` gives it (producer and
consumer may differ in tp where one size divides the other): it reads them (pull), or the producer
ranks holding them write them (push, :mod:`hwkv.connectors.p2p.push`); the producer frees a
request's blocks once every consumer rank was served.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hwkv.connectors.p2p.channel import SideChannel
from hwkv.connectors.p2p.consumer import ConsumerSide, LoadSpec
from hwkv.connectors.p2p.producer import ProducerSide
from hwkv.connectors.p2p.protocol import Layout, PushRequest
from hwkv.connectors.p2p.push import PushSide
from hwkv.connectors.p2p.transport import TransportSide
from hwkv.core.sched_output import KVConnectorOutput
from hwkv.interfaces.connector import KVConnectorBase

ROLES, MODES = ("producer", "consumer"), ("pull", "push")


class P2PConnector(TransportSide, PushSide, ProducerSide, ConsumerSide, KVConnectorBase):
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
        self._backend: Any = None
        self.transports: dict[str, tuple[Any, Any]] = {}  # protocol -> (Transfer, the KV cache it registered)
        self.layouts: dict[str, Layout] = {}  # protocol -> this rank's layout over it (first: preferred)
        self.dev: Any = None
        self.kv_cache: Any = None  # this rank's device KV cache (register_kv_caches)
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
        self._peers: dict[str, dict[str, Layout]] = {}  # consumer engine id -> its usable layouts by protocol
        self._producers: dict[str, list[Layout]] = {}  # producer side-channel address -> its ranks' layouts
        self.rank_layouts: list[Layout] = []  # every tensor-parallel rank's layout (scheduler side)
        self.total_kv_heads: int | None = None  # the model's (bind_model)
        # consumer
        self._offers: dict[str, tuple[int, int]] = {}  # rid -> (start, end) offered
        self._loads: dict[str, Any] = {}  # scheduler side: rid -> its pinned blocks, until every rank settled
        self._new_loads: list[Any] = []
        self._no_offer: set[str] = set()
        self._reading: dict[str, Any] = {}  # worker side: rid -> load into this rank's shard
        self._probed: dict[str, float] = {}  # producer side-channel address -> when its liveness was last probed
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
                             transfer_s=0.0)  # seconds in blocking transfers; + bytes_via_<protocol>

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
        self._backend = backend

    def bind_device(self, device: Any) -> None:
        self.dev = device

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
                    role=self.role, mode=self.mode, protocols=list(self.transports))

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


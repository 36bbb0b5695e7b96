"""The p2p connector's worker side, one per tensor-parallel rank: the rank's transfer engines over
its KV shard (and the host mirror tcp staging copies through), its side channel, and every transfer.
The driver's side channel also serves the holds its scheduler side created
(:class:`~hwkv.connectors.p2p.state.DriverState`); the others take push orders (push mode) or
serve nothing (pull mode). Its logic is in four mixins, by topic: :mod:`.transport` (protocols,
registration, staging, side-channel dispatch), :mod:`.consumer` (loads), :mod:`.producer` (holds,
layerwise writes), :mod:`.push` (a push split over the producer's ranks); the state they use is
declared here.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hwkv.connectors.base.roles import ConnectorWorker
from hwkv.connectors.p2p.channel import SideChannel
from hwkv.connectors.p2p.consumer import Consumer, _Load
from hwkv.connectors.p2p.producer import Producer
from hwkv.connectors.p2p.protocol import Layout
from hwkv.connectors.p2p.push import Pusher, _Parts
from hwkv.connectors.p2p.state import DriverState, P2PConfig, P2PMeta
from hwkv.connectors.p2p.transport import Transport
from hwkv.interfaces.connector import KVConnectorOutput


class P2PWorker(Transport, Pusher, Producer, Consumer, ConnectorWorker):
    def __init__(self, config: P2PConfig, state: DriverState):
        self.config, self.state = config, state
        self.layerwise = config.layerwise  # per-layer writes as the forward produces them (save_kv_layer)
        self.engine_id = uuid.uuid4().hex[:16]
        self.total_kv_heads: int | None = None  # the model's (bind_model_config)
        self._backend: Any = None
        self._backend_protocols: tuple[str, ...] | None = None
        self._backend_reason = ""
        # transport
        self.dev: Any = None
        self.kv_cache: Any = None  # this rank's device KV cache (register_kv_caches)
        self.host_kv: Any = None  # staging: pinned host mirror of the device KV (same block ids)
        self._mirror_pinned, self._mirror_lock = True, threading.Lock()
        self._stage_lock = threading.Lock()
        self.transports: dict[str, tuple[Any, Any]] = {}  # protocol -> (Transfer, the KV cache it registered)
        self.layouts: dict[str, Layout] = {}  # protocol -> this rank's layout over it (first: preferred)
        self.protocol = ""  # the preferred one of those offered (register_kv_caches)
        self.transfer: Any = None
        self.layout: Layout | None = None
        self.channel: SideChannel | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="p2p-transfer")
        # (kind "recv" | "sent", rid, ok, nbytes, settled, valid): completions from the side channel and transfer
        # threads
        self._results: queue.Queue[tuple[str, str, bool, int, bool, int]] = queue.Queue()
        self._wake = threading.Event()
        self._peers: dict[str, dict[str, Layout]] = {}  # consumer engine id -> its usable layouts (state.lock)
        # consumer
        self._producers: dict[str, list[Layout]] = {}  # producer side-channel address -> its ranks' layouts
        self._reading: dict[str, _Load] = {}  # rid -> load into this rank's shard
        self._probed: dict[str, float] = {}  # producer side-channel address -> when its liveness was last probed
        # producer
        self._parts: dict[str, _Parts] = {}  # push in progress per consumer rank: its producer ranks' parts
        self._staged: list[tuple[str, bool]] = []  # holds this rank staged (tensor parallelism)
        self._writes: list[Any] = []  # this step's layer writes
        self._idle = False
        self.counters = dict(loaded_bytes=0, stored_bytes=0, transfers=0, failed_transfers=0,
                             expired_holds=0, layer_writes=0,
                             transfer_s=0.0)  # seconds in blocking transfers; + bytes_via_<protocol>

    # ---- set-up --------------------------------------------------------------------------------
    def bind_model_config(self, model_config: Any) -> None:
        self.total_kv_heads = getattr(model_config, "num_kv_heads", None)

    def bind_backend(self, backend: Any) -> None:
        caps = backend.capabilities
        self._backend_protocols, self._backend_reason = tuple(caps.transfer_protocols), caps.transfer_reason
        self._backend = backend

    def bind_device(self, device: Any) -> None:
        self.dev = device

    def tp_worker_info(self) -> Any:
        return self.layout

    def stats(self) -> dict[str, Any]:
        return dict(self.counters, protocols=list(self.transports))

    # ---- per step ------------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: P2PMeta | None) -> None:
        meta = metadata if metadata is not None else P2PMeta([], [], False, [], [])
        self._writes, self._idle = meta.writes, meta.idle
        for rid, ids in meta.stage:  # a tensor-parallel producer's held request: this rank's shard to its host mirror
            try:
                self._stage(True, ids)
                self._staged.append((rid, True))
            except Exception:
                self._staged.append((rid, False))
        if self.tp_rank == 0:  # the driver's side channel speaks for the engine
            for p in meta.releases:
                self.send_release(p)
            self.start_ready()
        if meta.loads:
            self.start_loads(meta.loads)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        if self._idle and self._results.empty():
            self._wake.wait(0.002)  # nothing scheduled: wait for the side channel instead of spinning
        self._wake.clear()
        recv: set[str] = set()
        failed: set[str] = set()
        sent: set[str] = set()
        valid: dict[str, int] = {}
        while True:
            try:
                kind, rid, ok, nbytes, settled, landed = self._results.get_nowait()
            except queue.Empty:
                break
            self.counters["transfers" if ok else "failed_transfers"] += 1
            if kind == "recv":
                self.consumer_result(rid, ok, nbytes, settled, landed, recv, failed, valid)
                continue
            with self.state.lock:
                if self.state.held.pop(rid, None) is not None:
                    sent.add(rid)
                    self.counters["stored_bytes"] += nbytes
        now, settled = time.monotonic(), []
        self.consumer_poll(now, failed, settled)
        self.producer_poll(now, sent)
        staged, self._staged = self._staged, []
        if not (recv or failed or sent or settled or staged):
            return None
        extra = {k: v for k, v in (("p2p_settled", settled), ("p2p_staged", staged)) if v}
        return KVConnectorOutput(finished_sending=sent, finished_recving=recv, failed_recving=failed,
                                 valid_tokens=valid, extra=extra)

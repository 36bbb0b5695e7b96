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
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hwkv.connectors.copy import copy_block_pairs
from hwkv.connectors.p2p_channel import SideChannel, call
from hwkv.connectors.p2p_protocol import (
    Ack,
    Acquire,
    Hello,
    HelloReply,
    Layout,
    PushDone,
    PushRequest,
    Release,
    incompatibility,
    layout_of,
    pair_segments,
    prompt_digest,
)
from hwkv.core.request import RequestStatus
from hwkv.core.sched_output import KVConnectorOutput
from hwkv.interfaces.connector import KVConnectorBase

ROLES, MODES = ("producer", "consumer"), ("pull", "push")


@dataclass
class _Load:
    """Consumer: one request's incoming KV."""

    rid: str
    params: dict[str, Any]
    blocks: list[Any]  # pinned KVCacheBlocks of the request (all of them, in order)
    start: int
    end: int
    deadline: float = 0.0
    reported: bool = False  # finished_recving / failed_recving sent
    settled: bool = False  # no transfer into the blocks can still be running


@dataclass
class _Held:
    """Producer: a finished request's blocks kept for a consumer."""

    block_ids: list[int]
    num_tokens: int
    deadline: float
    busy: bool = False  # a read or write of them is running


class P2PConnector(KVConnectorBase):
    name = "p2p"

    def __init__(self, role: str, mode: str = "pull", host: str = "127.0.0.1", side_channel_port: int = 0,
                 protocol: str = "auto", metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
                 transfer_timeout_s: float = 10.0, hold_timeout_s: float = 60.0, staging: bool | None = None):
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
        self._results: queue.Queue[tuple[str, str, bool, int]] = queue.Queue()  # kind, rid, ok, nbytes
        self._wake = threading.Event()
        self._peers: dict[str, Layout] = {}  # side-channel address or engine id -> handshaken layout
        self._offers: dict[str, tuple[int, int]] = {}  # consumer: rid -> (start, end) offered
        self._loads: dict[str, _Load] = {}
        self._new_loads: list[_Load] = []
        self._no_offer: set[str] = set()
        self._unpin: list[list[Any]] = []
        self._held: dict[str, _Held] = {}
        self._idle = False
        self.counters = dict(loaded_bytes=0, stored_bytes=0, transfers=0, failed_transfers=0,
                             expired_holds=0, refused_offers=0)

    # ---- set-up --------------------------------------------------------------------------------
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
        xfer = self.host_kv if staging else kv_cache
        self.transfer = MooncakeTransfer(protocol=self.protocol, host=self.host, metadata_server=self.metadata_server,
                                         device_name=self.device_name, timeout_s=self.transfer_timeout_s)
        for t in xfer.tensors:
            self.transfer.register(t.data_ptr(), t.numel() * t.element_size())
        self.layout = layout_of(xfer, self.engine_id, self.transfer.endpoint(), self.protocol)
        self.channel = SideChannel(self.host, self.port, self._handle)

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
            if why:
                return HelloReply(None, why)
            with self._lock:
                self._peers[msg.layout.engine_id] = msg.layout
            return HelloReply(self.layout)
        if isinstance(msg, Acquire):
            with self._lock:
                h = self._held.get(msg.request_id)
                if h is None or h.busy:
                    return Ack(False, f"request {msg.request_id} is not held here (expired, freed or being read)")
                h.busy, h.deadline = True, time.monotonic() + 3 * self.transfer_timeout_s
            return Ack(True)
        if isinstance(msg, Release):
            self._done("sent", msg.request_id, msg.ok, 0)
            return Ack(True)
        if isinstance(msg, PushRequest):
            return self._accept_push(msg)
        if isinstance(msg, PushDone):
            self._done("recv", msg.request_id, msg.ok, msg.nbytes)
            return Ack(True)
        return Ack(False, f"unexpected message {type(msg).__name__}")

    def _done(self, kind: str, rid: str, ok: bool, nbytes: int) -> None:
        self._results.put((kind, rid, ok, nbytes))
        self._wake.set()

    def _handshake(self, address: str) -> Layout:
        peer = self._peers.get(address)
        if peer is None:
            reply = call(address, Hello(self.layout), self.transfer_timeout_s)  # type: ignore[arg-type]
            if not isinstance(reply, HelloReply) or reply.layout is None:
                raise RuntimeError(f"p2p handshake with {address} refused: {getattr(reply, 'reason', reply)}")
            why = incompatibility(self.layout, reply.layout)  # type: ignore[arg-type]
            if why:
                raise RuntimeError(f"p2p handshake with {address} refused: {why}")
            peer = self._peers[address] = reply.layout
        return peer

    # ---- producer ------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._offers.pop(rid, None)
        self._no_offer.discard(rid)
        params = request.kv_transfer_params or {}
        if self.role == "consumer" and params.get("do_remote_prefill"):
            request.kv_transfer_params = None  # consumed: the response carries none (as vLLM's decode side)
        if self.role != "producer" or not params.get("do_remote_decode") or self.layout is None \
                or request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        ids = list(block_ids[:-(-n // self.layout.block_size)])
        if n < 1 or not ids:
            return False, None
        if self.host_kv is not None:
            self._stage(True, ids)  # the request's last forward is done: its KV is complete
        with self._lock:
            self._held[rid] = _Held(ids, n, time.monotonic() + self.hold_timeout_s)
        host, port = self.channel.address.rsplit(":", 1)  # type: ignore[union-attr]
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "mode": self.mode,
            "remote_engine_id": self.engine_id, "remote_host": host, "remote_port": int(port),
            "remote_request_id": rid, "remote_block_ids": ids, "remote_num_tokens": n,
            "remote_block_size": self.layout.block_size,
            "prompt_digest": prompt_digest(request.prompt_token_ids[:n], request.cache_salt),
        }

    def _accept_push(self, msg: PushRequest) -> Ack:
        with self._lock:
            h = self._held.get(msg.request_id)
            peer = self._peers.get(msg.consumer_engine_id)
            if h is None or h.busy:
                return Ack(False, f"request {msg.request_id} is not held here (expired, freed or being sent)")
            if peer is None:
                return Ack(False, f"engine {msg.consumer_engine_id} did not handshake first")
            if msg.end > h.num_tokens or msg.start < 0:
                return Ack(False, f"tokens [{msg.start}, {msg.end}) are outside the held {h.num_tokens}")
            h.busy, h.deadline = True, time.monotonic() + 3 * self.transfer_timeout_s
        self._pool.submit(self._push, msg, h, peer)
        return Ack(True)

    def _push(self, msg: PushRequest, h: _Held, peer: Layout) -> None:
        ok, why, nbytes = True, "", 0
        try:
            sp, dp, ln = pair_segments(self.layout, peer, h.block_ids, msg.block_ids, msg.start, msg.end)  # type: ignore[arg-type]
            if ln:
                self.transfer.write(peer.endpoint, sp, dp, ln)
            nbytes = sum(ln)
        except Exception as e:
            ok, why = False, f"{type(e).__name__}: {e}"
        try:
            call(msg.notify, PushDone(msg.consumer_request_id, ok, why, nbytes), self.transfer_timeout_s)
        except Exception:
            ok = False  # the consumer times out and recomputes
        self._done("sent", msg.request_id, ok, nbytes)

    # ---- consumer: scheduler side --------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid, p = request.request_id, request.kv_transfer_params or {}
        if self.role != "consumer" or not p.get("do_remote_prefill") or rid in self._no_offer or self.layout is None:
            return 0, False
        why = self._refusal(request, p)
        if why:
            self._no_offer.add(rid)
            self.counters["refused_offers"] += 1
            import logging

            logging.getLogger(__name__).warning("p2p: request %s recomputes its prompt: %s", rid, why)
            return 0, False
        end = min(int(p["remote_num_tokens"]), request.num_tokens - 1)
        if end <= num_computed_tokens:
            return 0, False
        self._offers[rid] = (num_computed_tokens, end)
        return end - num_computed_tokens, True

    def _refusal(self, request: Any, p: dict[str, Any]) -> str:
        need = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids", "remote_num_tokens",
                "prompt_digest")
        missing = [k for k in need if k not in p]
        if missing:
            return f"kv_transfer_params lack {', '.join(missing)}"
        if p.get("mode", self.mode) != self.mode:
            return f"the producer runs mode {p.get('mode')!r}, this consumer {self.mode!r}"
        n = int(p["remote_num_tokens"])
        if n > request.num_prompt_tokens or \
                prompt_digest(request.prompt_token_ids[:n], request.cache_salt) != p["prompt_digest"]:
            return "the prompt (or cache_salt) differs from the one the producer prefilled"
        return ""

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        offer = self._offers.pop(rid, None)
        if offer is None or not num_external_tokens:
            return
        start, end = offer
        blocks = list(self.kv.get_blocks(rid))
        self.kv.block_pool.touch(blocks)  # pinned until no transfer can write them any more
        load = _Load(rid, dict(request.kv_transfer_params), blocks, start, start + num_external_tokens)
        self._loads[rid] = load
        self._new_loads.append(load)
        self._no_offer.add(rid)  # offered once: a preempted or failed request recomputes

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        loads, self._new_loads = self._new_loads, []
        return loads, scheduler_output.total_num_scheduled_tokens == 0

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for blocks in self._unpin:
            self.kv.block_pool.free_blocks(blocks)
        self._unpin = []

    def has_pending_transfers(self) -> bool:
        return bool(self._loads or self._held)

    def stats(self) -> dict[str, Any]:
        return dict(self.counters, loads_in_flight=len(self._loads), held_requests=len(self._held),
                    role=self.role, mode=self.mode)

    # ---- consumer: worker side -----------------------------------------------------------------
    def bind_connector_metadata(self, metadata: Any) -> None:
        loads, self._idle = metadata if metadata is not None else ([], False)
        deadline = time.monotonic() + 3 * self.transfer_timeout_s
        for load in loads:
            load.deadline = deadline
            self._pool.submit(self._pull if self.mode == "pull" else self._ask_push, load)

    def _pull(self, load: _Load) -> None:
        p, ok, nbytes = load.params, False, 0
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            peer = self._handshake(address)
            ack = call(address, Acquire(p["remote_request_id"]), self.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "acquire refused"))
            try:
                sp, dp, ln = pair_segments(peer, self.layout, list(p["remote_block_ids"]),  # type: ignore[arg-type]
                                           [b.block_id for b in load.blocks], load.start, load.end)
                if ln:
                    self.transfer.read(peer.endpoint, dp, sp, ln)
                ok, nbytes = True, sum(ln)
            finally:
                call(address, Release(p["remote_request_id"], ok), self.transfer_timeout_s)
        except Exception as e:
            import logging

            logging.getLogger(__name__).warning("p2p: pull of %s failed (it recomputes): %s", load.rid, e)
        self._done("recv", load.rid, ok, nbytes)

    def _ask_push(self, load: _Load) -> None:
        p = load.params
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            self._handshake(address)
            ack = call(address, PushRequest(p["remote_request_id"], self.engine_id, load.rid,
                                            [b.block_id for b in load.blocks], load.start, load.end,
                                            self.channel.address), self.transfer_timeout_s)  # type: ignore[union-attr]
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "push refused"))
        except Exception as e:
            import logging

            logging.getLogger(__name__).warning("p2p: push into %s not started (it recomputes): %s", load.rid, e)
            self._done("recv", load.rid, False, 0)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        if self._idle and self._results.empty():
            self._wake.wait(0.002)  # nothing scheduled: wait for the side channel instead of spinning
        self._wake.clear()
        recv, failed, sent = set(), set(), set()
        while True:
            try:
                kind, rid, ok, nbytes = self._results.get_nowait()
            except queue.Empty:
                break
            self.counters["transfers" if ok else "failed_transfers"] += 1
            if kind == "sent":
                with self._lock:
                    if self._held.pop(rid, None) is not None:
                        sent.add(rid)
                        self.counters["stored_bytes"] += nbytes
                continue
            load = self._loads.get(rid)
            if load is None:
                continue
            load.settled = True
            if not load.reported:
                load.reported = True
                if ok and self.host_kv is not None:
                    bs = self.kv_cache.spec.block_size
                    self._stage(False, [b.block_id for b in load.blocks[load.start // bs:-(-load.end // bs)]])
                (recv if ok else failed).add(rid)
                self.counters["loaded_bytes"] += nbytes if ok else 0
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            if not load.reported and now > load.deadline:
                load.reported = True  # recompute now; the blocks stay pinned until the transfer ends
                failed.add(rid)
                self.counters["failed_transfers"] += 1
            if load.settled or now > load.deadline + 3 * self.transfer_timeout_s:
                self._unpin.append(load.blocks)
                del self._loads[rid]
        with self._lock:
            for rid, h in list(self._held.items()):
                if now > h.deadline:  # the consumer never came (or died mid-read): free them
                    del self._held[rid]
                    sent.add(rid)
                    self.counters["expired_holds"] += 1
        if not (recv or failed or sent or self._unpin):
            return None
        return KVConnectorOutput(finished_sending=sent, finished_recving=recv, failed_recving=failed)

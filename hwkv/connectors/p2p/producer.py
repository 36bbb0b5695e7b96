"""The p2p connector's producer (prefill engine) side: hold a prefilled request's blocks for a
consumer, serve pull reads (Acquire/Release), WRITE them into a consumer's blocks (push), or, with
``layerwise``, write each layer's KV as soon as the forward wrote it into blocks a consumer
announced before the prefill ran (the consumer-first flow of vllm-ascend's layerwise connector).

State lives on :class:`~hwkv.connectors.p2p.connector.P2PConnector`; this mixin holds the producer's logic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hwkv.connectors.p2p.channel import call
from hwkv.connectors.p2p.protocol import (
    Ack,
    Acquire,
    Layout,
    PushDone,
    PushRequest,
    Release,
    pair_segments,
    prompt_digest,
)
from hwkv.core.request import RequestStatus


@dataclass
class _Held:
    """A finished request's blocks kept for a consumer."""

    rid: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    digest_of: Any = None  # (prompt ids, salt): checks a consumer-first push names the same prompt
    busy: bool = False  # a push (write) of them is running
    readers: set[int] = field(default_factory=set)  # consumer ranks that acquired them (pull) or asked a push
    staged: bool = True  # tensor-parallel staging: every rank copied them to its host mirror
    waiting: list[Any] = field(default_factory=list)  # pushes asked for before they were staged
    released: set[int] = field(default_factory=set)  # consumer ranks whose read ended / push was answered
    host_staged: bool = True  # in the host mirror (False: staged when a tcp reader or push first needs it)


@dataclass
class _Stream:
    """Layerwise push of one request: per-layer writes issued during its forwards."""

    msg: PushRequest
    peer: Layout
    batches: list[int] = field(default_factory=list)
    nbytes: int = 0
    failed: str = ""
    finished: bool = False  # the request finished prefill: once the batches end, notify


class ProducerSide:
    # ---- scheduler side ------------------------------------------------------------------------
    def producer_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid, params = request.request_id, request.kv_transfer_params or {}
        self._producing.pop(rid, None)
        stream = self._streams.get(rid)
        ok_end = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        ids = list(block_ids[:-(-n // self.layout.block_size)])
        if not ok_end or n < 1 or not ids:
            if stream is not None:
                stream.failed = stream.failed or f"the prefill request ended {request.status.name}"
                stream.finished = True
            return stream is not None, None  # in-flight layer writes read the blocks: freed once they end
        staged = self.host_kv is None or self.tp_size == 1
        eager = self.host_kv is not None and self.protocol == "tcp"  # else only for a peer that falls back to tcp
        if eager and staged:
            self._stage(True, ids)  # the request's last forward is done: its KV is complete
        elif not staged:  # every rank stages its shard at its next step's start (p2p_staged reports it)
            self._to_stage.append((rid, ids))
        with self._lock:
            h = self._held[rid] = _Held(rid, ids, n, time.monotonic() + self.hold_timeout_s,
                                        (request.prompt_token_ids, request.cache_salt), staged=staged,
                                        host_staged=eager or self.host_kv is None)
            tid = params.get("transfer_id")
            early = self._targets.pop(tid, None) if tid and stream is None else None
        if stream is not None:
            h.busy, stream.finished = True, True
        elif early is not None:  # announced during the prefill, too late for layer writes: one write now
            self._start_push(early[0], h, early[1])
        host, port = self.channel.address.rsplit(":", 1)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "mode": self.mode,
            "remote_engine_id": self.engine_id, "remote_host": host, "remote_port": int(port),
            "remote_request_id": rid, "remote_block_ids": ids, "remote_num_tokens": n,
            "remote_block_size": self.layout.block_size,
            "prompt_digest": prompt_digest(request.prompt_token_ids[:n], request.cache_salt),
        }

    def producer_admitted(self, request: Any) -> None:
        tid = (request.kv_transfer_params or {}).get("transfer_id")
        if tid:
            self._producing[request.request_id] = request
            self._by_transfer[tid] = request.request_id

    def layer_writes(self, so: Any) -> list[tuple[_Stream, list[int], int, int]]:
        """This step's layerwise writes: ``(stream, block ids, start, end)`` per request whose
        consumer announced its blocks before the request's first forward."""
        out = []
        for rid in so.preempted_req_ids:  # its blocks go back to the pool under in-flight layer writes
            if (st := self._streams.get(rid)) is not None:
                st.failed = st.failed or "the prefill request was preempted"
        for new in so.scheduled_new_reqs:
            req = self._producing.get(new.req_id)
            if req is None or new.req_id in self._streams:
                continue
            with self._lock:
                target = self._targets.pop(req.kv_transfer_params["transfer_id"], None)
            if target is None:
                continue
            msg, peer = target
            why = self._push_refusal(msg, req.prompt_token_ids, req.cache_salt, req.num_prompt_tokens)
            st = self._streams[new.req_id] = _Stream(msg, peer, failed=why)
            out.append((st, new.block_ids, 0, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]))
        cached = so.scheduled_cached_reqs
        for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
            st = self._streams.get(rid)
            if st is not None and not st.finished and c < st.msg.end:
                out.append((st, self.kv.get_block_ids(rid), c, c + so.num_scheduled_tokens[rid]))
        return out

    # ---- side channel --------------------------------------------------------------------------
    def accept_acquire(self, msg: Acquire) -> Ack:
        """Pull: consumer rank ``msg.reader`` is about to read; keep the blocks for it."""
        with self._lock:
            h = self._held.get(msg.request_id)
            if h is not None and not h.staged:
                return Ack(False, f"request {msg.request_id} is being staged", retry=True)
            if h is None or h.busy or msg.reader in h.readers:
                return Ack(False, f"request {msg.request_id} is not held here (expired, freed or being read)")
            h.readers.add(msg.reader)
            h.deadline = time.monotonic() + 3 * self.transfer_timeout_s
        try:
            self.stage_for(msg.protocol, h)  # a tcp reader while the pool's own protocol is device-direct
        except Exception as e:
            with self._lock:
                h.readers.discard(msg.reader)
            return Ack(False, f"staging request {msg.request_id} to host memory failed: {type(e).__name__}: {e}")
        return Ack(True)

    def accept_release(self, msg: Release) -> Ack:
        """Pull: a consumer rank's read ended; every consumer rank reads its heads, so the blocks go
        once all ``msg.readers`` released them (or the hold expires)."""
        with self._lock:
            h = self._held.get(msg.request_id)
            if h is not None and msg.readers > 1:
                h.released.add(msg.reader)
                if len(h.released) < msg.readers:
                    return Ack(True)
        self._done("sent", msg.request_id, msg.ok, 0)
        return Ack(True)

    def accept_push(self, msg: PushRequest) -> Ack:
        with self._lock:
            peers = self._peers.get(msg.consumer_engine_id)
            if peers is None:
                return Ack(False, f"engine {msg.consumer_engine_id} did not handshake first")
            peer = peers.get(msg.protocol) if msg.protocol else next(iter(peers.values()))
            if peer is None:
                return Ack(False, f"protocol {msg.protocol!r} was not agreed with engine {msg.consumer_engine_id} "
                                  f"(agreed: {', '.join(peers)})")
            rid = self._by_transfer.get(msg.request_id, msg.request_id)
            h = self._held.get(rid)
            if h is None:
                if rid not in self._producing and not msg.digest:
                    return Ack(False, f"request {msg.request_id} is not held here (expired or freed)")
                if msg.readers > 1 or self.tp_size > 1:
                    return Ack(False, "a consumer-first push (before the prefill finished) needs tp=1 on both "
                                      "sides (allowed under tensor parallelism: push after the prefill, or pull)")
                # consumer first (it names the prompt by digest): the prefill has not finished or not arrived
                self._targets[msg.request_id] = (msg, peer)
                self._target_deadlines[msg.request_id] = time.monotonic() + self.hold_timeout_s
                return Ack(True)
            if msg.reader in h.readers or (h.busy and not h.readers) or \
                    any(w[0].reader == msg.reader for w in h.waiting):  # busy without readers: a layerwise stream
                return Ack(False, f"request {msg.request_id} is being sent already")
            if not h.staged:  # started once every rank staged its shard (staged_holds)
                h.waiting.append((msg, peer))
                return Ack(True)
        self._start_push(msg, h, peer)
        return Ack(True)

    def staged_holds(self, done: list[Any]) -> None:
        """Scheduler side: holds every rank staged (``(rid, ok)``); the pushes that waited start."""
        for rid, ok, *_ in done:
            with self._lock:
                h = self._held.get(rid)
                if h is None:
                    continue
                h.staged, waiting, h.waiting = bool(ok), h.waiting, []
                if not ok:  # a rank could not stage: never served (readers retry until it expires, now)
                    h.deadline = 0.0
            for msg, peer in waiting:
                if ok:
                    self._start_push(msg, h, peer)
                else:
                    self._pool.submit(self._notify, msg, False, "staging the KV to host memory failed", 0, None)

    def _push_refusal(self, msg: PushRequest, prompt: list[int], salt: str | None, n: int) -> str:
        if msg.end > n or msg.start < 0:
            return f"tokens [{msg.start}, {msg.end}) are outside the prefilled {n}"
        if msg.digest and prompt_digest(prompt[:msg.end], salt) != msg.digest:
            return "the prompt (or cache_salt) differs from the one the producer prefilled"
        return ""

    def _start_push(self, msg: PushRequest, h: _Held, peer: Layout) -> None:
        with self._lock:
            h.busy, h.deadline = True, time.monotonic() + 3 * self.transfer_timeout_s
            h.readers.add(msg.reader)
        self._pool.submit(self._push, msg, h, peer)  # PushSide: split over this producer's ranks

    def _notify(self, msg: PushRequest, ok: bool, why: str, nbytes: int, rid: str | None,
                settled: bool = True) -> None:
        try:
            call(msg.notify, PushDone(msg.consumer_request_id, ok, why, nbytes, settled), self.transfer_timeout_s)
        except Exception:
            ok = False  # the consumer times out and recomputes
        if rid:
            with self._lock:  # every consumer rank asked for its heads: freed once all were answered
                h = self._held.get(rid)
                if h is not None and msg.readers > 1:
                    h.released.add(msg.reader)
                    if len(h.released) < msg.readers:
                        return
            self._done("sent", rid, ok, nbytes)

    # ---- worker side ---------------------------------------------------------------------------
    def save_kv_layer(self, layer: int, layer_kv: Any, attn_metadata: Any) -> None:
        if not self._writes:
            return
        ev = None
        if self.kv_cache.device.type != "cpu":  # the layer's KV exists once the forward's stream got there
            ev = self.dev.new_event()
            ev.record()
        for st, block_ids, start, end in self._writes:
            lo, hi = max(start, st.msg.start), min(end, st.msg.end)
            if st.failed or hi <= lo:
                continue
            try:
                transfer, mine = self.transfer_for(st.peer.protocol)
                sp, dp, ln = pair_segments(mine, st.peer, block_ids, st.msg.block_ids, lo, hi,
                                           layers=range(layer, layer + 1))
                if ln:
                    if ev is not None and not getattr(transfer, "orders_after", False):
                        ev.synchronize()  # a transport that cannot order on the device: the host waits
                        ev = None
                    # ordered on the device: the copy streams wait for the layer's event, the forward goes on
                    st.batches.append(transfer.submit_write(st.peer.endpoint, sp, dp, ln, after=ev) if ev is not None
                                      else transfer.submit_write(st.peer.endpoint, sp, dp, ln))
                    st.nbytes += sum(ln)
                    self.counters["layer_writes"] += 1
            except Exception as e:
                st.failed = f"layer {layer}: {type(e).__name__}: {e}"

    def producer_poll(self, now: float, sent: set[str]) -> None:
        """Finish layerwise streams whose writes ended; expire unclaimed holds and announcements."""
        for rid, st in list(self._streams.items()):
            pending = []
            transfer = self.transports.get(st.peer.protocol, (self.transfer,))[0]
            for b in st.batches:
                try:
                    if not transfer.poll(b):
                        pending.append(b)
                except Exception as e:
                    st.failed = st.failed or f"{type(e).__name__}: {e}"
            st.batches = pending
            if st.finished and not pending:
                del self._streams[rid]
                held = rid in self._held
                self._pool.submit(self._notify, st.msg, not st.failed, st.failed, st.nbytes, rid if held else None)
                if not held:  # ended without a hold (aborted): its blocks were kept only for the writes
                    sent.add(rid)
        with self._lock:
            for rid, h in list(self._held.items()):
                if now > h.deadline:  # the consumer never came (or died mid-transfer): free them
                    del self._held[rid]
                    for key in [k for k, p in self._parts.items() if p.rid == rid]:  # a rank never answered
                        del self._parts[key]
                    sent.add(rid)
                    self.counters["expired_holds"] += 1
            for tid, t in list(self._target_deadlines.items()):
                if now > t:
                    del self._target_deadlines[tid]
                    target = self._targets.pop(tid, None)
                    if target is not None:  # the prefill never came: the consumer recomputes now
                        self._pool.submit(self._notify, target[0], False, "the prefill request never arrived", 0,
                                          None)
            live = set(self._producing) | set(self._held) | set(self._streams)
            for tid in [t for t, r in self._by_transfer.items() if r not in live]:
                del self._by_transfer[tid]

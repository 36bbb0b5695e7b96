"""The p2p worker side's producer (prefill engine) part: serve the holds the scheduler side created
(:class:`~hwkv.connectors.p2p.state.DriverState`) on the driver's side channel - pull reads
(Acquire/Release), pushes that WRITE them into a consumer's blocks - and, with ``layerwise``, write
each layer's KV as soon as the forward wrote it into blocks a consumer announced before the prefill
ran (the consumer-first flow of vllm-ascend's layerwise connector); report holds sent or expired.

A mixin of :class:`~hwkv.connectors.p2p.worker.P2PWorker`, whose ``__init__`` declares the state it uses.
"""

from __future__ import annotations

import time
from typing import Any

from hwkv.connectors.p2p.channel import call
from hwkv.connectors.p2p.protocol import Ack, Acquire, Layout, PushDone, PushRequest, Release, kv_segments
from hwkv.connectors.p2p.state import Held


class Producer:
    # ---- side channel --------------------------------------------------------------------------
    def accept_acquire(self, msg: Acquire) -> Ack:
        """Pull: consumer rank ``msg.reader`` is about to read; keep the blocks for it."""
        with self.state.lock:
            h = self.state.held.get(msg.request_id)
            if h is not None and not h.staged:
                return Ack(False, f"request {msg.request_id} is being staged", retry=True)
            if h is None or h.busy or msg.reader in h.readers:
                return Ack(False, f"request {msg.request_id} is not held here (expired, freed or being read)")
            h.readers.add(msg.reader)
            h.deadline = time.monotonic() + 3 * self.config.transfer_timeout_s
        try:
            self.stage_for(msg.protocol, h)  # a tcp reader while the pool's own protocol is device-direct
        except Exception as e:
            with self.state.lock:
                h.readers.discard(msg.reader)
            return Ack(False, f"staging request {msg.request_id} to host memory failed: {type(e).__name__}: {e}")
        return Ack(True)

    def accept_release(self, msg: Release) -> Ack:
        """Pull: a consumer rank's read ended; every consumer rank reads its heads, so the blocks go
        once all ``msg.readers`` released them (or the hold expires)."""
        with self.state.lock:
            h = self.state.held.get(msg.request_id)
            if h is not None and msg.readers > 1:
                h.released.add(msg.reader)
                if len(h.released) < msg.readers:
                    return Ack(True)
        self._done("sent", msg.request_id, msg.ok, 0)
        return Ack(True)

    def accept_push(self, msg: PushRequest) -> Ack:
        with self.state.lock:
            peers = self._peers.get(msg.consumer_engine_id)
            if peers is None:
                return Ack(False, f"engine {msg.consumer_engine_id} did not handshake first")
            peer = peers.get(msg.protocol) if msg.protocol else next(iter(peers.values()))
            if peer is None:
                return Ack(False, f"protocol {msg.protocol!r} was not agreed with engine {msg.consumer_engine_id} "
                                  f"(agreed: {', '.join(peers)})")
            rid = self.state.by_transfer.get(msg.request_id, msg.request_id)
            h = self.state.held.get(rid)
            if h is None:
                if rid not in self.state.producing and not msg.digest:
                    return Ack(False, f"request {msg.request_id} is not held here (expired or freed)")
                if msg.readers > 1 or self.tp_size > 1:
                    return Ack(False, "a consumer-first push (before the prefill finished) needs tp=1 on both "
                                      "sides (allowed under tensor parallelism: push after the prefill, or pull)")
                # consumer first (it names the prompt by digest): the prefill has not finished or not arrived
                self.state.targets[msg.request_id] = (msg, peer)
                self.state.target_deadlines[msg.request_id] = time.monotonic() + self.config.hold_timeout_s
                return Ack(True)
            if msg.reader in h.readers or (h.busy and not h.readers) or \
                    any(w[0].reader == msg.reader for w in h.waiting):  # busy without readers: a layerwise stream
                return Ack(False, f"request {msg.request_id} is being sent already")
            if not h.staged:  # started once every rank staged its shard (staged_holds)
                h.waiting.append((msg, peer))
                return Ack(True)
        self._start_push(msg, h, peer)
        return Ack(True)

    def _start_push(self, msg: PushRequest, h: Held, peer: Layout) -> None:
        with self.state.lock:
            self.state.claim(h, msg, self.config.transfer_timeout_s)
        self._pool.submit(self._push, msg, h, peer)  # Pusher: split over this producer's ranks

    def start_ready(self) -> None:
        """Start the pushes the scheduler side released (claimed there), or answer the failed ones."""
        with self.state.lock:
            ready, self.state.ready = self.state.ready, []
        for msg, h, peer, ok in ready:
            if ok:
                self._pool.submit(self._push, msg, h, peer)
            else:
                self._pool.submit(self._notify, msg, False, "staging the KV to host memory failed", 0, None)

    def _notify(self, msg: PushRequest, ok: bool, why: str, nbytes: int, rid: str | None,
                settled: bool = True, valid: int = 0) -> None:
        try:
            done = PushDone(msg.consumer_request_id, ok, why, nbytes, settled, 0 if ok or valid <= msg.start else valid)
            call(msg.notify, done, self.config.transfer_timeout_s)
        except Exception:
            ok = False  # the consumer times out and recomputes
        if rid:
            with self.state.lock:  # every consumer rank asked for its heads: freed once all were answered
                h = self.state.held.get(rid)
                if h is not None and msg.readers > 1:
                    h.released.add(msg.reader)
                    if len(h.released) < msg.readers:
                        return
            self._done("sent", rid, ok, nbytes)

    # ---- layerwise writes, polling ------------------------------------------------------------
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
                sp, dp, ln = kv_segments(mine, st.peer, block_ids, st.msg.all_block_ids, lo, hi, st.msg.end,
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
        for rid, st in list(self.state.streams.items()):
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
                del self.state.streams[rid]
                held = rid in self.state.held
                self._pool.submit(self._notify, st.msg, not st.failed, st.failed, st.nbytes, rid if held else None)
                if not held:  # ended without a hold (aborted): its blocks were kept only for the writes
                    sent.add(rid)
        with self.state.lock:
            for rid, h in list(self.state.held.items()):
                if now > h.deadline:  # the consumer never came (or died mid-transfer): free them
                    del self.state.held[rid]
                    for key in [k for k, p in self._parts.items() if p.rid == rid]:  # a rank never answered
                        del self._parts[key]
                    sent.add(rid)
                    self.counters["expired_holds"] += 1
            for tid, t in list(self.state.target_deadlines.items()):
                if now > t:
                    del self.state.target_deadlines[tid]
                    target = self.state.targets.pop(tid, None)
                    if target is not None:  # the prefill never came: the consumer recomputes now
                        self._pool.submit(self._notify, target[0], False, "the prefill request never arrived", 0,
                                          None)
            live = set(self.state.producing) | set(self.state.held) | set(self.state.streams)
            for tid in [t for t, r in self.state.by_transfer.items() if r not in live]:
                del self.state.by_transfer[tid]

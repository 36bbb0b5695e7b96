"""Publishing KV events over ZMQ (vLLM's wire protocol), and a subscriber that keeps an index of them.

Opt-in: ``Engine(..., kv_events_endpoint="tcp://127.0.0.1:5557")`` (``hwkv serve --kv-events-endpoint``).

Wire protocol (vLLM's ``ZmqEventPublisher``, so its subscribers work unchanged):

* PUB socket at ``endpoint``: one message per engine step that changed a cache tier, multipart
  ``(topic, seq as 8 bytes big-endian, msgpack(KVEventBatch))``; ``seq`` counts from 0 per publisher
  and the first batch (seq 0) is ``[AllBlocksCleared()]`` — a new or restarted engine holds nothing.
* ROUTER socket at ``replay_endpoint`` (optional): a client (DEALER: ``(b"", start_seq)``) sends
  ``start_seq`` (8 bytes big-endian) and gets every batch still buffered (the last
  ``buffer_steps``) with ``seq >= start_seq``, one ``(b"", seq, payload)`` message each, then
  ``(b"", END_SEQ, b"")`` with ``END_SEQ = -1`` (8 bytes, signed).
* hwkv extension on the replay socket: the request ``b"snapshot"`` (answered by ``END_SEQ`` at
  once) makes the engine's next step publish a snapshot batch — ``AllBlocksCleared()`` followed by
  ``BlockStored`` of every block each tier holds (``token_ids`` empty, ``parent_block_hash``
  ``None``) — for a subscriber whose gap reaches past the replay buffer.

Ordering: events are appended as the cache changes, taken once per step (after the step's outputs
are applied) and published in that order; a subscriber applying batches in ``seq`` order has the
engine's hash sets as of the end of that step. The engine step only numbers and queues a batch; a
sender thread encodes and sends it, and replay requests are served on a thread of their own.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from hwkv.core.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

log = logging.getLogger("hwkv.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNAPSHOT = b"snapshot"
_NOBLOCK = 1  # zmq.NOBLOCK, without importing zmq at module level


def _check_endpoint(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"{name}={value!r} is invalid (need a ZMQ endpoint: 'tcp://127.0.0.1:5557', "
                         "'tcp://127.0.0.1:*' for a free port, 'ipc:///path' or 'inproc://name')")
    return value


class KVEventPublisher:
    """PUB + replay ROUTER sockets (module docstring). ``endpoint`` and ``replay_endpoint`` are the
    bound addresses (a ``*`` port resolved).

    The engine's step only numbers a batch and queues it (:meth:`publish`: a deque append); a
    sender thread encodes (msgpack) and sends it, as vLLM's publisher does, so the step pays
    neither (about 0.15 us per event to encode plus a send, ~100 us for a 256-event batch). The
    sender wakes every ``send_interval_s`` (5 ms) and sends everything queued, one message per
    batch as before: waking it per step (an ``Event.set`` and a GIL hand-off each ~1 ms step at 256
    decodes) cost the step more than the events themselves. A subscriber sees a batch at most
    ``send_interval_s`` later; ``0`` wakes the sender at every batch. The
    replay socket has a thread of its own, which sleeps in ``zmq.poll`` (GIL released) until a
    request comes."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, data_parallel_rank: int | None = None,
                 send_interval_s: float = 0.005):
        import zmq

        _check_endpoint("kv_events_endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("kv_events_replay_endpoint", replay_endpoint)
        if not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise ValueError(f"buffer_steps={buffer_steps!r} is invalid (need an int >= 1)")
        if isinstance(send_interval_s, bool) or not isinstance(send_interval_s, (int, float)) \
                or not 0 <= send_interval_s <= 1:
            raise ValueError(f"send_interval_s={send_interval_s!r} is invalid (need seconds in [0, 1])")
        self.send_interval_s = float(send_interval_s)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, hwm)  # past it a slow subscriber loses batches: a gap it replays
        self._replay = None
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"kv events: cannot bind {endpoint!r} / {replay_endpoint!r} ({e})") from None
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._enc = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: deque[tuple[int, float, list[Any]]] = deque()  # numbered, not yet sent
        self._wake = threading.Event()
        self._seq = 0  # the next batch's number (batches numbered so far)
        self.snapshot_wanted = False
        self.published = 0  # batches sent
        self._closed = False
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="hwkv-kv-events-send", daemon=True)
        self._sender.start()
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve, name="hwkv-kv-events-replay", daemon=True)
            self._thread.start()
        self.publish([AllBlocksCleared()])  # seq 0: this engine holds nothing yet
        atexit.register(_close_ref, weakref.ref(self))

    def publish(self, events: list[Any]) -> None:
        """Number one step's events as one batch (the next ``seq``) and queue it for the sender
        thread (nothing when empty). Batches go out in ``seq`` order."""
        if not events or self._closed:
            return
        self._queue.append((self._seq, time.time(), events))
        self._seq += 1
        if not self.send_interval_s and not self._wake.is_set():
            self._wake.set()

    def _send_loop(self) -> None:
        """The sender thread: encode and send what is queued, in order; at close, what is left."""
        enc, q, pub, topic = self._enc, self._queue, self._pub, self.topic
        wait = self.send_interval_s or 0.1
        while True:
            self._wake.wait(wait)  # close() wakes it at once
            self._wake.clear()
            while q:
                seq, ts, events = q.popleft()
                try:
                    payload = enc.encode(KVEventBatch(ts, events, self.data_parallel_rank))
                    self._buffer.append((seq, payload))  # before the send: a replay asked meanwhile includes it
                    pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=_NOBLOCK)
                except Exception as e:  # a lost batch is a gap: subscribers replay it from the buffer
                    log.warning("kv events: sending batch %d failed: %s", seq, e)
                self.published += 1
            if self._stop.is_set() and not q:
                return

    def publish_step(self, sources: Iterable[Any], snapshot: Callable[[], list[Any]]) -> None:
        """Take every source's events (``take_kv_events()``), plus a snapshot when one was asked
        for, and publish them as one batch."""
        events: list[Any] = []
        for src in sources:
            events += src.take_kv_events()
        if self.snapshot_wanted:
            self.snapshot_wanted = False
            events.append(AllBlocksCleared())
            events += snapshot()
        self.publish(events)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the replay thread and close the sockets, batches still queued on the PUB socket
        given up to ``timeout_s`` to reach connected subscribers (ZMQ linger). Idempotent; also run
        at interpreter exit (atexit) for a publisher never closed."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        for t in (self._sender, self._thread):
            if t is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        if not self._sender.is_alive() and (self._thread is None or not self._thread.is_alive()):
            self._close_sockets(linger_ms=int(max(0.0, deadline - time.monotonic()) * 1000))

    def _serve(self) -> None:
        """The replay thread."""
        while not self._stop.is_set():
            try:
                if self._replay.poll(100):  # type: ignore[union-attr]
                    self._serve_replay()
            except Exception as e:  # never a dead replay thread
                log.warning("kv events: replay request failed: %s", e)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:
            log.warning("kv events: invalid replay request (%d frames)", len(frames))
            return
        client, _, req = frames
        if req == SNAPSHOT:
            self.snapshot_wanted = True
        elif len(req) == 8:
            start = int.from_bytes(req, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))  # type: ignore
        else:
            log.warning("kv events: invalid replay request %r", req[:16])
        self._replay.send_multipart((client, b"", END_SEQ, b""))  # type: ignore[union-attr]

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._pub.close(linger=linger_ms)  # the flush: term() waits (at most this) for queued batches
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def _close_ref(ref: weakref.ref) -> None:
    pub = ref()
    if pub is not None:
        pub.close(timeout_s=1.0)


def snapshot_events(kv_cache_manager: Any, connector: Any = None) -> list[Any]:
    """``BlockStored`` of everything each tier holds now (device prefix cache, and the connector's
    tiers: ``KVConnectorBase.kv_event_snapshot``)."""
    bp = getattr(kv_cache_manager, "event_pool", None) or kv_cache_manager.block_pool  # groups: the one reported
    out: list[Any] = []
    if bp.kv_events is not None and bp.cached_block_hash_to_block:
        out.append(BlockStored(list(bp.cached_block_hash_to_block), None, [], bp.event_block_size, None,
                               bp.medium or MEDIUM_GPU))
    if connector is not None:
        out += connector.kv_event_snapshot()
    return out


# ---- subscribing --------------------------------------------------------------------------------
class KVEventIndex:
    """What one instance holds, per medium, rebuilt from its events (a subscriber's view)."""

    def __init__(self) -> None:
        self.media: dict[str, set[Any]] = {}
        self.block_size: dict[str, int] = {}  # tokens per hash, per medium (from BlockStored)

    def apply(self, events: list[Any]) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.media.clear()
            elif isinstance(ev, BlockStored):
                medium = ev.medium or MEDIUM_GPU
                self.media.setdefault(medium, set()).update(ev.block_hashes)
                self.block_size[medium] = ev.block_size
            elif isinstance(ev, BlockRemoved):
                self.media.get(ev.medium or MEDIUM_GPU, set()).difference_update(ev.block_hashes)

    def hashes(self, medium: str = MEDIUM_GPU) -> set[Any]:
        return self.media.get(medium, set())

    def prefix_len(self, hashes: list[Any], medium: str = MEDIUM_GPU) -> int:
        """Leading blocks of ``hashes`` held in ``medium``."""
        held = self.media.get(medium)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


class KVEventSubscriber:
    """Follows one publisher: applies its batches in ``seq`` order to :attr:`index` on a thread.

    Late start and gaps: it first replays from seq 0; a gap in the stream is filled by a replay
    from the missing seq; when the replay buffer no longer reaches back (or there is no replay
    socket), it asks for a snapshot, clears its index and applies nothing until the snapshot batch
    (first event ``AllBlocksCleared``) arrives. A publisher that restarted (seq back to 0) is
    followed from its seq 0 batch, which clears the index; one that restarted while we missed its
    first batches is noticed when the batch before a gap, or (every ``probe_s`` of silence) the
    last batch applied, is no longer the publisher's. ``on_change`` runs after each applied batch
    (on the subscriber's thread)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 replay_timeout_s: float = 2.0, probe_s: float = 1.0, on_change: Callable[[], None] | None = None):
        import zmq

        self.endpoint, self.replay_endpoint = _check_endpoint("endpoint", endpoint), replay_endpoint
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        self.topic = topic.encode()
        self.replay_timeout_s = replay_timeout_s
        self.on_change = on_change
        self.index = KVEventIndex()
        self.lock = threading.Lock()  # held while the index changes
        self.next_seq: int | None = None
        self.awaiting_snapshot = False
        self._dup_floor = 0  # live batches below next_seq and from here on are replayed duplicates
        self._seq0 = b""  # the seq-0 batch applied: another one means the publisher restarted
        self._last: tuple[int, bytes] | None = None  # the last batch applied
        self.probe_s = probe_s
        self.stats = dict(batches=0, replays=0, replayed=0, snapshots=0, restarts=0)
        self._dec = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hwkv-kv-events-sub", daemon=True)
        self._thread.start()
        # a subscriber never closed stops at interpreter exit: its thread closes its sockets and the
        # context before the interpreter tears down (a context collected under a live socket aborts)
        atexit.register(_close_ref, weakref.ref(self))

    def wait_ready(self, timeout_s: float = 5.0) -> bool:
        """True once connected and the first replay is done."""
        return self._ready.wait(timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread (it closes the sockets). Idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            self._catch_up(0)
            self._ready.set()
            quiet_since = time.monotonic()
            while not self._stop.is_set():
                if not sub.poll(50):
                    if time.monotonic() - quiet_since > self.probe_s:
                        self._probe()  # a publisher that restarted and stayed quiet sends nothing
                        quiet_since = time.monotonic()
                    continue
                _, seq_b, payload = sub.recv_multipart()
                self._receive(int.from_bytes(seq_b, "big"), payload)
                quiet_since = time.monotonic()
        except Exception as e:  # a subscriber thread must never die silently
            log.warning("kv events subscriber of %s stopped: %s", self.endpoint, e)
        finally:
            sub.close(linger=0)
            self._ctx.term()

    def _receive(self, seq: int, payload: bytes) -> None:
        """A live message."""
        nxt = self.next_seq
        if nxt is not None and seq < nxt:
            if seq >= self._dup_floor and not (seq == 0 and payload != self._seq0):
                return  # a batch the last replay already gave us
            self._restart()  # the publisher restarted (its seq went back)
        elif nxt is not None and seq > nxt:
            self._catch_up(nxt)  # a gap: replay what we missed
        if self.next_seq is None or seq >= self.next_seq:
            self._apply(seq, payload)
        if not self.awaiting_snapshot:
            self._dup_floor = self.next_seq or 0  # live and in order now: no replayed copy can follow

    def _restart(self) -> None:
        self.stats["restarts"] += 1
        self.next_seq, self._dup_floor, self.awaiting_snapshot, self._last = None, 0, False, None
        self._catch_up(0)

    def _probe(self) -> None:
        """While the stream is quiet: is the last batch we applied still the publisher's batch of
        that seq? If not, the publisher restarted (or moved past its buffer): start over. If so,
        apply what followed it: batches lost at the end of a burst (a PUB drops what it sends
        before a new SUB's subscription arrives) leave no later batch to reveal the gap."""
        if self._last is None or self.replay_endpoint is None or self.awaiting_snapshot:
            return
        got = self._replay(self._last[0])
        if got is None:
            return
        if not got or got[0] != self._last:
            self._restart()
            return
        for seq, payload in got[1:]:
            if self.next_seq is not None and seq >= self.next_seq:
                self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = self._dec.decode(payload)
        if seq == 0:
            self._seq0 = payload
        self.next_seq, self._last = seq + 1, (seq, payload)
        if self.awaiting_snapshot:
            if not batch.events or not isinstance(batch.events[0], AllBlocksCleared):
                return
            self.awaiting_snapshot = False
        with self.lock:
            self.index.apply(batch.events)
        self.stats["batches"] += 1
        if self.on_change is not None:
            self.on_change()

    def _catch_up(self, start: int) -> None:
        """Replay from ``start`` (from the last batch applied, which must still be the publisher's:
        else it restarted); ask for a snapshot when the buffer does not reach back."""
        if self._last is not None and start == self._last[0] + 1:
            got = self._replay(start - 1)
            if got is not None and (not got or got[0] != self._last):
                self._restart()
                return
            got = got[1:] if got else got
        else:
            got = self._replay(start)
        if got is None or (got and got[0][0] > start):
            self._ask_snapshot()
            return
        for seq, payload in got:
            if self.next_seq is None or seq >= self.next_seq:
                self._apply(seq, payload)
        self._dup_floor = start

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches from ``start`` on, or None without a replay socket / answer."""
        import zmq

        if self.replay_endpoint is None:
            return None
        self.stats["replays"] += 1
        s = self._ctx.socket(zmq.DEALER)  # several replies to one request: a REQ socket takes only one
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            s.send_multipart((b"", start.to_bytes(8, "big")))
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not s.poll(int(left * 1000)):
                    return None
                frames = s.recv_multipart()
                if len(frames) != 3:
                    return None
                _, seq_b, payload = frames
                if seq_b == END_SEQ:
                    break
                out.append((int.from_bytes(seq_b, "big"), payload))
        except zmq.ZMQError:
            return None
        finally:
            s.close(linger=0)
        self.stats["replayed"] += len(out)
        return out

    def _ask_snapshot(self) -> None:
        import zmq

        self.stats["snapshots"] += 1
        with self.lock:
            self.index.media.clear()
        self.awaiting_snapshot = True
        if self.replay_endpoint is None:
            return  # no way to ask: the next AllBlocksCleared (restart, reset) resynchronises
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.replay_endpoint)
        try:
            s.send_multipart((b"", SNAPSHOT))
            s.poll(int(self.replay_timeout_s * 1000))
        finally:
            s.close(linger=0)


__all__ = ["END_SEQ", "KVEventIndex", "KVEventPublisher", "KVEventSubscriber", "MEDIUM_CPU", "MEDIUM_GPU",
           "snapshot_events"]

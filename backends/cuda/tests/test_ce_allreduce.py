"""The copy-engine all-reduce's schedules (hwkv_cuda.ce_allreduce: CopyEngineAllReduce, CopyEngineOneShot) on
CPU: every rank a thread, the buffers host tensors, the copies memmoves and the flags int64 words a rank spins
on — the same chunks, slots, flags and epochs the CUDA transport drives on the copy engines. Every rank must end
with the sum in rank order (float32, rounded once) of every rank's tensor, bit for bit, over ragged lengths, several
rounds (messages longer than the buffers) and calls back to back (the single-buffer reuse argument)."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest
import torch
from hwkv_cuda.ce_allreduce import CopyEngineAllReduce, Transport


class _HostTransport(Transport):
    def __init__(self, stop: threading.Event):
        self.stop = stop

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def signal(self, addr: int, value: int) -> None:
        ctypes.c_int64.from_address(addr).value = value

    def wait(self, addr: int, value: int) -> None:
        t0 = time.monotonic()
        while ctypes.c_int64.from_address(addr).value < value:
            if self.stop.is_set() or time.monotonic() - t0 > 20:
                raise TimeoutError(f"flag at {addr:#x} never reached {value}")
            time.sleep(0)


def _run(ws: int, chunk_max: int, inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    bufs = [torch.zeros(CopyEngineAllReduce.buffer_bytes(ws, chunk_max), dtype=torch.uint8) for _ in range(ws)]
    addrs = [b.data_ptr() for b in bufs]
    stop = threading.Event()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        ce = CopyEngineAllReduce(r, ws, addrs, bufs[r], chunk_max, _HostTransport(stop))
        try:
            for t in inputs[r]:
                ce.all_reduce(t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ws)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    return inputs


def _want(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rank_holds_the_rank_order_sum(ws, dtype):
    g = torch.Generator().manual_seed(ws)
    # ragged lengths (a last chunk shorter, one shorter than a rank count of aligned chunks), several rounds
    # (a message of more than ws x chunk_max bytes) and calls back to back over the same buffers
    lengths = [4096 * ws + 1000, 37, 3 * 1024 + 5, 20000, 8]
    chunk_max = 4096
    inputs = [[(torch.randn(n, generator=g) * 4).to(dtype) for n in lengths] for _ in range(ws)]
    wants = [_want([inputs[r][i].clone() for r in range(ws)]) for i in range(len(lengths))]
    got = _run(ws, chunk_max, inputs)
    for r in range(ws):
        for i, want in enumerate(wants):
            assert torch.equal(got[r][i], want), (r, i)


def test_the_sum_is_in_rank_order():
    """Three ranks where the order matters in float32 (1e8 + 1 - 1e8): every rank rounds ((x0 + x1) + x2)."""
    vals = [torch.tensor([1e8] * 300, dtype=torch.float32), torch.tensor([1.0] * 300), torch.tensor([-1e8] * 300)]
    got = _run(3, 512, [[v.clone()] for v in vals])
    want = (vals[0] + vals[1]) + vals[2]
    for r in range(3):
        assert torch.equal(got[r][0], want)


class _Stream:
    """A CUDA stream's order on the host: a thread running the functions put on it, in order."""

    def __init__(self, stop: threading.Event):
        import queue

        self.q: queue.Queue = queue.Queue()
        self.stop = stop
        self.error: BaseException | None = None
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        while True:
            fn = self.q.get()
            if fn is None:
                return
            try:
                if self.error is None:
                    fn()
            except BaseException as e:  # noqa: BLE001 - reported by sync
                self.error = e
                self.stop.set()

    def put(self, fn) -> None:
        self.q.put(fn)

    def record(self) -> threading.Event:
        ev = threading.Event()
        self.put(ev.set)
        return ev

    def wait_event(self, ev: threading.Event) -> None:
        def w():
            while not ev.wait(0.05):
                if self.stop.is_set():
                    raise TimeoutError("an event never came")

        self.put(w)

    def sync(self) -> None:
        self.record().wait(60)
        self.put(None)
        self.th.join(5)
        if self.error is not None:
            raise self.error


class _StreamTransport(_HostTransport):
    """The host transport with the one-shot form's two streams: the side stream's copies and flags and the
    waiting stream's waits and sums run on threads of their own, as on a GPU (a rank's host never blocks).
    ``side`` and ``main`` may be one :class:`_Stream`: one FIFO, as two CUDA streams sharing a hardware queue
    (a blocked wait then holds up everything queued behind it, whichever stream it came from)."""

    def __init__(self, stop: threading.Event, side: _Stream, main: _Stream):
        super().__init__(stop)
        self.side, self.main = side, main
        self.cur = self.main

    def begin_side(self, side, main) -> None:
        if self.side is not self.main:
            self.side.wait_event(self.main.record())
        self.cur = self.side

    def end_side(self):
        return self.side.record()

    def begin_wait(self, sent) -> None:
        if self.side is not self.main:
            self.main.wait_event(sent)
        self.cur = self.main

    def copy(self, dst, src, nbytes) -> None:
        self.cur.put(lambda: _HostTransport.copy(self, dst, src, nbytes))

    def signal(self, addr, value) -> None:
        self.cur.put(lambda: _HostTransport.signal(self, addr, value))

    def wait(self, addr, value) -> None:
        self.cur.put(lambda: _HostTransport.wait(self, addr, value))

    def sum(self, x, slots, rank, out) -> None:
        self.cur.put(lambda: Transport.sum(self, x, slots, rank, out))

    def add_norm(self, *args) -> None:
        self.cur.put(lambda: Transport.add_norm(self, *args))


def _run_oneshot(ws: int, slot_max: int, calls: list[list[tuple]], sharing: str) -> list[list]:
    """Every rank starts its calls in order with the call before still in flight (the prefill halves' pattern),
    each ``(tensor, norm or None)``; returns every rank's results in call order. ``sharing``: ``none`` (every
    rank's two streams apart, a host thread per rank), ``rank`` (a rank's streams one FIFO), ``all`` (every
    stream of every rank one FIFO, one host thread interleaving the ranks call by call: one GPU, one process)."""
    from hwkv_cuda.ce_allreduce import CopyEngineOneShot

    bufs = [torch.zeros(CopyEngineOneShot.buffer_bytes(ws, slot_max), dtype=torch.uint8) for _ in range(ws)]
    addrs = [b.data_ptr() for b in bufs]
    stop = threading.Event()
    errors: list[BaseException] = []
    results: list[list] = [[] for _ in range(ws)]
    one = _Stream(stop) if sharing == "all" else None
    trs = []
    for _ in range(ws):
        side = one or _Stream(stop)
        trs.append(_StreamTransport(stop, side, side if sharing != "none" else _Stream(stop)))
    ces = [CopyEngineOneShot(r, ws, addrs, bufs[r], slot_max, trs[r]) for r in range(ws)]
    waits: list[list] = [[] for _ in range(ws)]

    def step(r: int, i: int) -> None:
        t, norm = calls[r][i]
        waits[r].append(ces[r].start(t, norm=norm))
        if len(waits[r]) == 2:
            results[r].append(waits[r].pop(0)())

    def rank(r: int) -> None:
        try:
            for i in range(len(calls[r])):
                step(r, i)
            results[r] += [w() for w in waits[r]]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            stop.set()

    if sharing == "all":
        for i in range(len(calls[0])):
            for r in range(ws):
                step(r, i)
        for r in range(ws):
            results[r] += [w() for w in waits[r]]
    else:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(ws)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    streams = {id(s): s for tr in trs for s in (tr.side, tr.main)}
    for st in streams.values():
        try:
            st.sync()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    assert not errors, errors
    return results


@pytest.mark.parametrize("sharing", ["none", "rank", "all"])
@pytest.mark.parametrize("ws", [2, 3])
def test_one_shot_sums_and_norms_with_a_call_in_flight(ws, sharing):
    """The one-shot form: plain sums (flat and rows) and sums fused into the residual add + RMSNorm, six calls each
    started with the call before in flight (both parities, the consumed flags): every rank holds the rank-order
    sum bit for bit, and h / the norm as add_rms_norm gives them - also where a rank's streams, or every stream,
    are one FIFO (CUDA streams sharing a hardware queue): no deadlock."""
    from hwkv.model.layers import add_rms_norm

    g = torch.Generator().manual_seed(10 + ws)
    hid = 64
    shapes = [(12, hid), (3, hid), (1000,), (7, hid), (12, hid), (5, hid)]
    norms = [True, False, False, True, True, True]
    slot_max = 1000 * 2
    w = (torch.rand(hid, generator=g) + 0.5).to(torch.bfloat16)
    res = {i: (torch.randn(s, generator=g)).to(torch.bfloat16) for i, s in enumerate(shapes) if norms[i]}
    parts = [[(torch.randn(s, generator=g) * 3).to(torch.bfloat16) for s in shapes] for _ in range(ws)]
    calls = [[(parts[r][i].clone(), (res[i], w, 1e-5) if norms[i] else None) for i in range(len(shapes))]
             for r in range(ws)]
    got = _run_oneshot(ws, slot_max, calls, sharing)
    for i in range(len(shapes)):
        s = _want([parts[r][i] for r in range(ws)])
        want = add_rms_norm(s, res[i], w, 1e-5) if norms[i] else s
        for r in range(ws):
            if norms[i]:
                assert torch.equal(got[r][i][1], want[1]) and torch.equal(got[r][i][0], want[0]), (r, i)
            else:
                assert torch.equal(got[r][i], want), (r, i)


def test_one_shot_refuses_what_could_deadlock():
    """A message over the slot, or a start while the call two before is still in flight: refused (the CUDA
    all-reduce then declines the tensor on every rank alike)."""
    from hwkv_cuda.ce_allreduce import CopyEngineOneShot

    stop = threading.Event()
    buf = torch.zeros(CopyEngineOneShot.buffer_bytes(2, 256), dtype=torch.uint8)
    st = _Stream(stop)
    ce = CopyEngineOneShot(0, 2, [buf.data_ptr(), buf.data_ptr()], buf, 256, _StreamTransport(stop, st, st))
    assert not ce.fits(torch.zeros(129, dtype=torch.bfloat16)) and ce.fits(torch.zeros(128, dtype=torch.bfloat16))
    ce.start(torch.zeros(8))
    assert ce.can_start()  # one call in flight
    ce.start(torch.zeros(8))
    assert not ce.can_start()  # the call two before the next is still in flight
    with pytest.raises(ValueError, match="in flight"):
        ce.start(torch.zeros(8))
    st.sync()  # the copies queued above ran (into buf) before it is freed

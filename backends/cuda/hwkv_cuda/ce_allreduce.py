"""Copy-engine all-reduce for prefill-sized messages (``HWKV_CE_ALLREDUCE``): the bytes cross NVLink on
the GPUs' copy engines (DMA), not on SMs, so the sum can run beside the GEMMs of the other row half of
a prefill forward (``Communicator.overlap_tokens``) without taking SMs from them, as NCCL's kernels do.

One round over a flat message of ``n`` elements, every rank owning chunk ``r`` (``ceil(n / ws)``
elements, the last one shorter), all on one side stream of this rank:

1. **reduce-scatter by DMA**: for every peer ``j``, ``cudaMemcpyAsync`` of this rank's chunk ``j``
   into this rank's slot of peer ``j``'s ``recv`` buffer (a push: writes cross NVLink once);
2. a flag write on every peer (``cuStreamWriteValue64``, with its memory barrier: the copy before it
   completed) — ``rs[me] = epoch``; then the stream waits (``cuStreamWaitValue64``, no SM) until
   every peer raised ``rs[peer] >= epoch`` here;
3. one small SM kernel: own chunk + every peer's slot in rank order, in float32, rounded once (the
   same bits as every other path), written into the tensor's own chunk and into this rank's ``out``
   buffer;
4. **all-gather by DMA**: flag ``ag[me] = epoch`` on every peer, wait for every peer's, then pull each
   peer's ``out`` into that peer's chunk of the tensor (the destination is local: any tensor works).

Two barriers a round make single buffers safe: a peer writes this rank's ``recv`` again only after
its pull of this round (step 4, which waited for this rank's ``ag`` flag, raised after this rank's
sum read ``recv``), and this rank writes ``out`` again only after waiting for the peers' next
``rs`` flags, raised after their pulls. Every round of a rank runs on the same stream (the
synchronous path is a start and an immediate wait) so the argument holds whatever mixes the caller
makes. Messages above the buffers' size run as several rounds. The epoch is a host counter: the
path is eager only (it declines inside graph capture, where the caller's NCCL takes the message).

``Transport`` is the device-facing half (copies, flag writes and waits, the sum); the schedule
(:class:`CopyEngineAllReduce`) is the same for the CUDA transport and the threads-on-CPU one the
tests use.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import torch

# the rs+ag form: a round's chunk per rank (recv + out buffers: ws x CHUNK_MAX per rank); the one-shot form: its
# slot, the largest message it takes (2 x (ws - 1) x CHUNK_MAX per rank: 256 MB for two ranks; a prefill step of
# the default 16,384 tokens x 4096 bf16 is 128 MB)
CHUNK_MAX = 128 * 1024 * 1024
CE_MIN = 16 * 1024 * 1024  # messages of at least this many bytes take the copy engines (eager only)
ALIGN = 256  # chunk boundaries in bytes (copy engines and the sum kernel like aligned runs)


def ce_mode() -> str:
    """``HWKV_CE_ALLREDUCE``: ``1`` the reduce-scatter + all-gather form, ``2`` the one-shot form
    (:class:`CopyEngineOneShot`), ``0`` off (the default until measured)."""
    v = os.environ.get("HWKV_CE_ALLREDUCE", "0")
    if v not in ("0", "1", "2"):
        raise ValueError(f"HWKV_CE_ALLREDUCE={v!r} (allowed: 0, 1, 2)")
    return {"0": "", "1": "rsag", "2": "oneshot"}[v]


def ce_enabled() -> bool:
    return bool(ce_mode())


class Transport:
    """What a round needs of the device, on one stream: ``copy(dst, src, nbytes)`` (addresses),
    ``signal(addr, value)`` (a flag write ordered after everything before it on the stream, visible
    to the peer with the data before it), ``wait(addr, value)`` (the stream waits until the local
    flag at ``addr`` is ``>= value``), ``sum(x, recv_slots, out)``."""

    def begin_side(self, side: Any, main: Any) -> None:
        """The copies, signals and waits that follow go to ``side``, ordered after ``main``'s work so far."""

    def end_side(self) -> Any:
        """A mark of the side stream's work enqueued so far (an event), for :meth:`begin_wait`."""
        return None

    def begin_wait(self, sent: Any) -> None:
        """What follows goes to the waiting (current) stream, after ``sent`` (a mark of :meth:`end_side`)."""

    def end_wait(self) -> None:
        """The waiting stream's part is enqueued."""

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        raise NotImplementedError

    def signal(self, addr: int, value: int) -> None:
        raise NotImplementedError

    def wait(self, addr: int, value: int) -> None:
        raise NotImplementedError

    def sum(self, x: torch.Tensor, slots: list[torch.Tensor], rank: int, out: torch.Tensor | None) -> None:
        """``x`` (and ``out``, if given) ``= x + slots`` summed in rank order (``slots[i]``: the peers'
        parts, in rank order without ``rank``), in float32, rounded once."""
        y = _rank_sum(x, slots, rank)
        x.copy_(y)
        if out is not None:
            out.copy_(y)

    def add_norm(self, x: torch.Tensor, slots: list[torch.Tensor], rank: int, residual: torch.Tensor,
                 weight: torch.Tensor, eps: float, out: torch.Tensor, h: torch.Tensor) -> None:
        """Rows ``[R, H]``: ``h = residual + (x + slots in rank order, rounded)``, ``out = rms_norm(h) * weight``
        with ``hwkv.model.layers.add_rms_norm``'s rounding."""
        from hwkv.model.layers import add_rms_norm

        o, hh = add_rms_norm(_rank_sum(x, slots, rank), residual, weight, eps)
        out.copy_(o)
        h.copy_(hh)


def _rank_sum(x: torch.Tensor, slots: list[torch.Tensor], rank: int) -> torch.Tensor:
    acc = None
    peers = iter(slots)
    for r in range(len(slots) + 1):
        part = x if r == rank else next(peers)
        acc = part.float() if acc is None else acc + part.float()
    return acc.to(x.dtype)


class CopyEngineAllReduce:
    """The schedule of the copy-engine all-reduce over ``ws`` ranks (module doc). ``bufs[r]``: rank
    ``r``'s buffer address as mapped here (``recv`` of ``(ws - 1) x chunk_max`` bytes, ``out`` of
    ``chunk_max``, then ``2 x ws`` int64 flags), ``local``: this rank's buffer as a tensor."""

    def __init__(self, rank: int, ws: int, bufs: list[int], local: torch.Tensor, chunk_max: int,
                 transport: Transport):
        self.rank, self.ws, self.bufs, self.local = rank, ws, bufs, local
        self.chunk_max = chunk_max
        self.flags_offset = ws * chunk_max  # rs[ws], ag[ws] (int64) from here
        self.t = transport
        self.epoch = 0

    @staticmethod
    def buffer_bytes(ws: int, chunk_max: int) -> int:
        return ws * chunk_max + 2 * ws * 8

    def _flag(self, rank: int, kind: int, src: int) -> int:
        """Address (as mapped here) of flag ``kind`` (0: reduce-scatter, 1: all-gather) that rank
        ``src`` raises in rank ``rank``'s buffer."""
        return self.bufs[rank] + self.ws * self.chunk_max + (kind * self.ws + src) * 8

    def _slot(self, rank: int, src: int) -> int:
        """Address of rank ``src``'s slot in rank ``rank``'s recv."""
        return self.bufs[rank] + (src if src < rank else src - 1) * self.chunk_max

    def _out(self, rank: int) -> int:
        return self.bufs[rank] + (self.ws - 1) * self.chunk_max

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum the contiguous ``t`` over the ranks in place (rounds of at most ``ws x chunk_max``
        bytes), every round on the transport's stream."""
        flat = t.view(-1)
        es = flat.element_size()
        per_round = self.ws * (self.chunk_max // es)
        for lo in range(0, flat.numel(), per_round):
            self._round(flat[lo: lo + per_round])
        return t

    def _round(self, x: torch.Tensor) -> None:
        ws, me, es, n = self.ws, self.rank, x.element_size(), x.numel()
        align = max(1, ALIGN // es)
        per = -(-n // ws)  # ceil
        chunk = -(-per // align) * align
        bounds = [(min(r * chunk, n), min((r + 1) * chunk, n)) for r in range(ws)]
        self.epoch += 1
        e, base = self.epoch, x.data_ptr()
        peers = [j for j in range(ws) if j != me]
        for j in peers:  # 1. reduce-scatter: my part of chunk j into j's recv
            lo, hi = bounds[j]
            if hi > lo:
                self.t.copy(self._slot(j, me), base + lo * es, (hi - lo) * es)
        for j in peers:  # 2.
            self.t.signal(self._flag(j, 0, me), e)
        for j in peers:
            self.t.wait(self._flag(me, 0, j), e)
        lo, hi = bounds[me]
        if hi > lo:  # 3. the sum of my chunk, in rank order, into x and out
            slots = [self.local[(j if j < me else j - 1) * self.chunk_max:][: (hi - lo) * es].view(x.dtype)
                     for j in peers]
            out = self.local[(ws - 1) * self.chunk_max:][: (hi - lo) * es].view(x.dtype)
            self.t.sum(x[lo:hi], slots, me, out)
        for j in peers:  # 4. all-gather: pull every peer's summed chunk
            self.t.signal(self._flag(j, 1, me), e)
        for j in peers:
            self.t.wait(self._flag(me, 1, j), e)
        for j in peers:
            lo, hi = bounds[j]
            if hi > lo:
                self.t.copy(base + lo * es, self._out(j), (hi - lo) * es)


class CopyEngineOneShot:
    """The one-shot form (``HWKV_CE_ALLREDUCE=2``): each rank's whole tensor crosses to every peer by DMA on the
    side stream as soon as it is ready, and the sum runs on the caller's stream when it waits — fused into the
    next RMSNorm where the caller asks (:meth:`start` with ``norm``): no SM work on the side stream, so nothing
    waits for SMs a GEMM holds, and one barrier a call. For two ranks the bytes are the reduce-scatter +
    all-gather's (each rank sends its whole tensor once); more ranks send ``ws - 1`` times more.

    Call ``e`` (parity ``p = e % 2``; one message of at most ``slot_max`` bytes, :meth:`fits`): the side stream
    waits until every peer consumed this rank's call ``e - 2`` (flag ``consumed``, written by the peer's stream
    after its sum), copies the tensor into this rank's slot of every peer's ``recv[p]`` and raises
    ``arrived = e`` there; the waiting stream waits for this rank's own copy (an event: an in-place sum
    overwrites what it reads) and its ``arrived`` flags (``cuStreamWaitValue64``), sums (or sums, adds and
    norms) and raises ``consumed = e`` on every peer. Buffer: ``recv`` of 2 parities x ``(ws - 1)`` slots of
    ``slot_max`` bytes, then ``arrived`` and ``consumed`` (``ws`` int64 each).

    No deadlock, even where a rank's streams share one hardware queue (a blocked stream-memory wait then holds
    up every command queued behind it): every wait is for a command the peer enqueued before the matching
    point of the same program — ``arrived = e`` at the peer's start of ``e``, before its wait of ``e``;
    ``consumed = e - 2`` at the peer's wait of ``e - 2``, which must come before this start of ``e``
    (:meth:`can_start`: the caller keeps at most the call before in flight, as the prefill halves do). A first
    version split messages into several rounds per start and deadlocked on one GPU that way: a later round's
    copy waited for the peers' sums of a call not yet waited for."""

    def __init__(self, rank: int, ws: int, bufs: list[int], local: torch.Tensor, slot_max: int,
                 transport: Transport, side: Any = None):
        self.rank, self.ws, self.bufs, self.local = rank, ws, bufs, local
        self.slot_max, self.t, self.side = slot_max, transport, side
        self.chunk_max = slot_max
        self.flags_offset = 2 * (ws - 1) * slot_max  # arrived[ws], consumed[ws] (int64) from here
        self.epoch = 0
        self.pending: set[int] = set()  # calls started and not waited for

    @staticmethod
    def buffer_bytes(ws: int, slot_max: int) -> int:
        return 2 * (ws - 1) * slot_max + 2 * ws * 8

    def _flag(self, rank: int, kind: int, src: int) -> int:
        """Flag ``kind`` (0: arrived, 1: consumed) that rank ``src`` raises in rank ``rank``'s buffer."""
        return self.bufs[rank] + 2 * (self.ws - 1) * self.slot_max + (kind * self.ws + src) * 8

    def _slot_off(self, rank: int, src: int, parity: int) -> int:
        return (parity * (self.ws - 1) + (src if src < rank else src - 1)) * self.slot_max

    def fits(self, t: torch.Tensor) -> bool:
        return t.numel() * t.element_size() <= self.slot_max

    def can_start(self) -> bool:
        """Whether the call two before the next one was waited for (module doc: no deadlock otherwise)."""
        return self.epoch - 1 not in self.pending

    def start(self, t: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
              main: Any = None) -> Callable[[], Any]:
        """Send ``t`` (contiguous, :meth:`fits`; :meth:`can_start`) to every peer on the side stream; ``wait()``
        (on the stream current when it is called) sums in place and returns ``t`` — or with ``norm =
        (residual, weight, eps)`` returns ``(rms_norm(h) * weight, h)``, ``h = residual + sum``, new tensors.
        ``main``: the stream the side stream orders after (CUDA: the current one)."""
        if not self.fits(t) or not self.can_start():
            raise ValueError("copy-engine one-shot: a message over the slot or a third call in flight")
        ws, me = self.ws, self.rank
        peers = [j for j in range(ws) if j != me]
        nbytes = t.numel() * t.element_size()
        self.epoch += 1
        e, p = self.epoch, self.epoch % 2
        self.pending.add(e)
        self.t.begin_side(self.side, main)
        if e > 2:
            for j in peers:
                self.t.wait(self._flag(me, 1, j), e - 2)
        for j in peers:
            self.t.copy(self.bufs[j] + self._slot_off(j, me, p), t.data_ptr(), nbytes)
        for j in peers:
            self.t.signal(self._flag(j, 0, me), e)
        sent = self.t.end_side()

        def wait() -> Any:
            self.t.begin_wait(sent)
            for j in peers:
                self.t.wait(self._flag(me, 0, j), e)
            slots = [self.local[self._slot_off(me, j, p):][:nbytes].view(t.dtype).view(t.shape) for j in peers]
            out = h = None
            if norm is None:
                self.t.sum(t, slots, me, None)
            else:
                out, h = torch.empty_like(t), torch.empty_like(t)
                self.t.add_norm(t, slots, me, norm[0], norm[1], norm[2], out, h)
            for j in peers:
                self.t.signal(self._flag(j, 1, me), e)
            self.t.end_wait()
            self.pending.discard(e)
            return t if norm is None else (out, h)

        return wait


class _Driver:
    """``cuStreamWriteValue64`` / ``cuStreamWaitValue64`` and ``cudaMemcpyAsync`` through ctypes."""

    _instance: _Driver | None = None

    @classmethod
    def get(cls) -> _Driver:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def __init__(self) -> None:
        from hwkv_cuda.ipc import _Cuda

        cu = _Cuda.get()
        self.cuda, c = cu, ctypes
        drv = cu.drv
        self.write = getattr(drv, "cuStreamWriteValue64_v2", None) or drv.cuStreamWriteValue64
        self.waitv = getattr(drv, "cuStreamWaitValue64_v2", None) or drv.cuStreamWaitValue64
        for fn in (self.write, self.waitv):
            fn.argtypes, fn.restype = [c.c_void_p, c.c_uint64, c.c_uint64, c.c_uint], c.c_int
        self.memcpy = cu.rt.cudaMemcpyAsync

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"copy-engine all-reduce: {what} failed (CUresult {rc})")


class CudaTransport(Transport):
    """The CUDA transport: copies on the copy engines (``cudaMemcpyAsync`` between this GPU and a
    peer's IPC-mapped buffer), flags by stream memory operations (no SM; ``signal="kernel"``: one-thread
    Triton kernels instead, where a driver refuses memory operations on peer memory), the sum by a
    Triton kernel. Every call goes to ``self.stream`` (set by the caller)."""

    def __init__(self, device: torch.device, signal: str = "memop"):
        self.device = device
        self.drv = _Driver.get()
        self.mode = signal
        self.stream: Any = None

    def _s(self) -> int:
        return self.stream.cuda_stream

    def begin_side(self, side: Any, main: Any) -> None:
        main = main if main is not None else torch.cuda.current_stream(self.device)
        side.wait_stream(main)
        self.stream = side

    def end_side(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def begin_wait(self, sent: Any) -> None:
        cur = torch.cuda.current_stream(self.device)
        if sent is not None:
            cur.wait_event(sent)
        self.stream = cur

    def add_norm(self, x: torch.Tensor, slots: list[torch.Tensor], rank: int, residual: torch.Tensor,
                 weight: torch.Tensor, eps: float, out: torch.Tensor, h: torch.Tensor) -> None:
        from hwkv_cuda.kernels.allreduce import ce_add_norm_kernel

        rows, hid, ws = x.shape[0], x.shape[1], len(slots) + 1
        stride = (slots[1].data_ptr() - slots[0].data_ptr()) // x.element_size() if len(slots) > 1 else 0
        block = 1 << (hid - 1).bit_length()
        with torch.cuda.stream(self.stream):
            ce_add_norm_kernel[(rows,)](x, slots[0], residual, weight, out, h, hid, eps, stride, RANK=rank, WS=ws,
                                        BLOCK=block, num_warps=8 if hid >= 4096 else 4)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        rc = self.drv.memcpy(ctypes.c_void_p(dst), ctypes.c_void_p(src), nbytes, 4, ctypes.c_void_p(self._s()))
        if rc != 0:
            self.drv.cuda.check(rc, f"cudaMemcpyAsync of {nbytes} B")

    def signal(self, addr: int, value: int) -> None:
        if self.mode == "memop":
            self.drv.check(self.drv.write(ctypes.c_void_p(self._s()), addr, value, 0), "cuStreamWriteValue64")
            return
        from hwkv_cuda.kernels.allreduce import ce_signal_kernel

        with torch.cuda.stream(self.stream):
            ce_signal_kernel[(1,)](addr, value)

    def wait(self, addr: int, value: int) -> None:
        if self.mode == "memop":
            self.drv.check(self.drv.waitv(ctypes.c_void_p(self._s()), addr, value, 0), "cuStreamWaitValue64 (GEQ)")
            return
        from hwkv_cuda.kernels.allreduce import ce_wait_kernel

        with torch.cuda.stream(self.stream):
            ce_wait_kernel[(1,)](addr, value)

    def sum(self, x: torch.Tensor, slots: list[torch.Tensor], rank: int, out: torch.Tensor | None) -> None:
        from hwkv_cuda.kernels.allreduce import ce_sum_kernel

        n, ws = x.numel(), len(slots) + 1
        stride = (slots[1].data_ptr() - slots[0].data_ptr()) // x.element_size() if len(slots) > 1 else 0
        block = 4096
        with torch.cuda.stream(self.stream):
            ce_sum_kernel[(-(-n // block),)](x, slots[0], x if out is None else out, n, stride, RANK=rank, WS=ws,
                                             BLOCK=block, HAS_OUT=out is not None, num_warps=8)


def make_ce(rank: int, ws: int, device: torch.device, peer_buffer: Callable[[int, str], tuple[torch.Tensor, Any]],
            chunk_max: int = CHUNK_MAX, signal: str | None = None,
            mode: str = "rsag") -> tuple[Any, torch.cuda.Stream]:
    """The CUDA copy-engine all-reduce of this rank (``mode``: ``rsag`` or ``oneshot``) and its side stream (a
    high-priority stream: its sums start as soon as SMs free up beside a GEMM). ``peer_buffer(nbytes, tag)``:
    a zeroed local buffer and every rank's address (CUDA IPC; ``CudaAllReduce._peer_buffer``). ``chunk_max``:
    the rsag form's chunk per rank, the one-shot form's slot."""
    cls = CopyEngineOneShot if mode == "oneshot" else CopyEngineAllReduce
    buf, ptrs = peer_buffer(cls.buffer_bytes(ws, chunk_max), "ce")
    addrs = [int(p) for p in ptrs.tolist()]
    transport = CudaTransport(device, signal or os.environ.get("HWKV_CE_SIGNAL", "memop"))
    side = torch.cuda.Stream(device, priority=-1)
    transport.stream = side
    if mode == "oneshot":
        return CopyEngineOneShot(rank, ws, addrs, buf, chunk_max, transport, side), side
    return CopyEngineAllReduce(rank, ws, addrs, buf, chunk_max, transport), side

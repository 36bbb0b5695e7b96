"""The copy-engine all-reduce's schedule (hwkv_cuda.ce_allreduce.CopyEngineAllReduce) on CPU: every rank a
thread, the buffers host tensors, the copies memmoves and the flags int64 words a rank spins on — the same
chunks, slots, flags and epochs the CUDA transport drives on the copy engines. Every rank must end with the
sum in rank order (float32, rounded once) of every rank's tensor, bit for bit, over ragged lengths, several
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

"""The L2 prefetch kernel reads every element (its sink is the xor of the whole tensor) and the
device's prefetch/join pair is capturable beside a real forward (GPU)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch
from hwkv_cuda.kernels.prefetch import prefetch_kernel


@pytest.mark.parametrize("n,programs,block", [(1, 1, 16), (1000, 3, 64), (4096, 4, 256)])
def test_prefetch_kernel_reads_everything(n, programs, block):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device=dev)
    sink = torch.zeros(programs, dtype=torch.int32, device=dev)
    prefetch_kernel[(programs,)](x, sink, n, BLOCK=block)
    assert functools.reduce(operator.xor, sink.tolist()) == functools.reduce(operator.xor, x.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_in_graph_capture():
    from hwkv_cuda.device import CudaDevice

    d = CudaDevice(0)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        d.prefetch([w])
        y = x @ w.t()
        d.join_prefetch()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        d.prefetch([w, torch.zeros(3, device="cuda", dtype=torch.bfloat16)])  # odd-sized: skipped
        out = x @ w.t()
        d.join_prefetch()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)

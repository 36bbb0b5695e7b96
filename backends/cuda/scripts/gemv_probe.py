"""Probe: can a Triton GEMV beat cuBLAS (``F.linear``) on the small-M decode projections?

At batch 1 the qkv / o_proj GEMMs of a 1B model run at ~1.5 TB/s under cuBLAS (docs/gpu-e2e.md),
about half the copy bandwidth. This script times, for each weight shape of the model, ``F.linear``
against a plain split-N Triton GEMV over a small config sweep, both as CUDA-graph replays over 16
distinct weight copies (the model streams 16 layers: nothing stays in L2), and prints TB/s.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/gemv_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Llama-3.2-1B (hidden 2048, 32/8 heads of 128, intermediate 8192): (name, N, K)
SHAPES = [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)]
COPIES = 16


@triton.jit
def gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    n_mask = offs_n < N
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None], other=0.0)
        for m in tl.static_range(M_PAD):
            x = tl.load(x_ptr + m * stride_xm + offs_k, mask=(offs_k * 0 + m) < M, other=0.0)
            part = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & n_mask[None, :])


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, block_n: int, block_k: int, warps: int,
         stages: int) -> None:
    M, K = x.shape
    N = w.shape[0]
    gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                            M_PAD=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=block_k,
                                            num_warps=warps, num_stages=stages)


def _each(fn, ws: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    for w, y in zip(ws, ys):
        fn(w, y)


def _gemv_wy(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: tuple[int, int, int, int]) -> None:
    gemv(x, w, y, *cfg)


def time_graph(fn, reps: int = 20) -> float:
    """µs per call of ``fn`` (one call per weight copy inside one captured graph)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / reps / COPIES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--m", default="1")
    args = ap.parse_args()
    torch.manual_seed(0)
    res: dict = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                     triton=triton.__version__, rows=[])
    n = 1 << 28
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    res["copy_TBps"] = 2 * n / time_graph(lambda: [dst.copy_(src) for _ in range(COPIES)]) / 1e6
    print(f"copy {res['copy_TBps']:.3f} TB/s", flush=True)
    sweep = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (3,)))
    for name, N, K in SHAPES:
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5 for _ in range(COPIES)]
        for M in map(int, args.m.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
            nbytes = N * K * 2 + M * (N + K) * 2
            t_cublas = time_graph(partial(_each, lambda w, y, x=x: torch.matmul(x, w.t(), out=y), ws, ys))
            ref = F.linear(x, ws[0]).float()
            best = None
            for bn, bk, wp, st in sweep:
                if bk > K:
                    continue
                try:
                    gemv(x, ws[0], ys[0], bn, bk, wp, st)
                    err = (ys[0].float() - ref).abs().max().item()
                    if err > 0.05:
                        print(f"{name} M={M} {bn},{bk},{wp},{st}: wrong (max err {err})")
                        continue
                    t = time_graph(partial(_each, partial(_gemv_wy, x, cfg=(bn, bk, wp, st)), ws, ys))
                except Exception as e:  # a config may not compile (shared memory)
                    print(f"{name} M={M} {bn},{bk},{wp},{st}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, dict(block_n=bn, block_k=bk, warps=wp, stages=st))
            row = dict(shape=name, N=N, K=K, M=M, MB=nbytes / 1e6, cublas_us=t_cublas,
                       cublas_TBps=nbytes / t_cublas / 1e6, triton_us=best[0] if best else None,
                       triton_TBps=nbytes / best[0] / 1e6 if best else None, triton_cfg=best[1] if best else None)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        ws.clear()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv-probe.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

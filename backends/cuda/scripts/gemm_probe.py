"""The split-K linear (:mod:`hwkv_cuda.gemm`) against cuBLAS (``F.linear``) at the projections of a Llama shape and
a few token counts: µs per call (:func:`graph_us`: replayed from a CUDA graph, L2 flushed before each call, as a
decode step's weights are not in L2), the rule's tile (``choose``) and a small sweep around it
(``HWKV_CUDA_GEMM_CONFIG``), each checked against cuBLAS's result. One JSON line per (shape, tokens, variant);
``--out`` collects them.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/gemm_probe.py --out gemm-probe.json \\
        --shapes 1b --tokens 256,128,64
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from hwkv_cuda.gemm import CONFIG_ENV, ENV, SplitKLinear

SHAPES = {  # name: {projection: (N, K)}
    "1b": {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
    "8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "8b-tp2": {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)},  # a rank's
}
SWEEP = ["", "split_k=1", "split_k=2", "split_k=4", "split_k=8", "block_n=64", "num_warps=4", "num_stages=3",
         "block_m=64", "block_k=128,num_stages=3"]


def graph_us(fn, reps: int = 20) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of ``reps`` calls, each after an L2 flush (a 256 MB write):
    the host's launch cost (the Python wrapper, Triton's launcher) is out, as in the engine's decode graphs.
    (Batch 2 of session 7 timed eager calls with ``do_bench``: the split-K wrapper's host time, not its kernel.)"""
    flush = torch.empty(1 << 26, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the warm-up on the capture's stream (the split-K counters are per stream)
        fn()
    torch.cuda.synchronize()
    g, gf = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(reps):
            flush.zero_()
            fn()
    with torch.cuda.graph(gf, stream=stream):
        for _ in range(reps):
            flush.zero_()
    times = []
    for graph in (g, gf):
        graph.replay()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return max(0.0, times[0] - times[1]) / reps * 1e3


def bmm_split(x: torch.Tensor, w: torch.Tensor, s: int, fp32: bool) -> torch.Tensor:
    """``x @ w.T`` as ``s`` K-slices in one strided batched cuBLAS call (``[s, M, N]`` partials: fp32 with ``fp32``,
    else the input dtype), summed over the slices: split-K without a kernel of ours."""
    m, k = x.shape
    n = w.shape[0]
    xs = x.view(m, s, k // s).transpose(0, 1)  # [s, M, K/s], rows k apart
    ws = w.view(n, s, k // s).permute(1, 2, 0)  # [s, K/s, N], column-major slices
    if fp32:
        return torch.bmm(xs, ws, out_dtype=torch.float32).sum(0).to(x.dtype)
    return torch.bmm(xs, ws).sum(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--tokens", default="256,128,64")
    ap.add_argument("--sweep", default=";".join(SWEEP), help="';'-separated HWKV_CUDA_GEMM_CONFIG values ('' = rule)")
    ap.add_argument("--bmm", default="", help="','-separated split counts of bmm_split to time (e.g. '2,4'); each "
                    "with fp32 and with 16-bit partials")
    ap.add_argument("--swap", action="store_true", help="time W @ x.T (then transposed back) as well")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ[ENV] = "1"
    op = SplitKLinear()
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes.split(","):
        for name, (n, k) in SHAPES[shape].items():
            w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
            for m in map(int, args.tokens.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                ref = F.linear(x, w)
                base = graph_us(lambda x=x, w=w: F.linear(x, w)) / 1e3
                row = dict(shape=shape, proj=name, m=m, n=n, k=k, variant="cublas", us=base * 1e3,
                           tflops=2 * m * n * k / base / 1e9)
                print(json.dumps(row), flush=True)
                rows.append(row)
                # cuBLASLt's heuristics (with its workspace, split-K algorithms are candidates) for the same call
                lib = torch.backends.cuda.preferred_blas_library()
                try:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    err = float((F.linear(x, w).float() - ref.float()).norm() / ref.float().norm())
                    t = graph_us(lambda x=x, w=w: F.linear(x, w)) / 1e3
                    row = dict(shape=shape, proj=name, m=m, variant="cublaslt", us=t * 1e3,
                               tflops=2 * m * n * k / t / 1e9, vs_cublas=base / t, rel_err=err)
                except Exception as e:  # noqa: BLE001 - a torch without the switch
                    row = dict(shape=shape, proj=name, m=m, variant="cublaslt", error=repr(e)[:200])
                finally:
                    torch.backends.cuda.preferred_blas_library(lib)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if args.swap:  # the transposed problem (W @ x.T) and its transpose copied back: other cuBLAS tiles?
                    y = torch.mm(w, x.t()).t().contiguous()
                    err = float((y.float() - ref.float()).norm() / ref.float().norm())
                    t = graph_us(lambda x=x, w=w: torch.mm(w, x.t()).t().contiguous()) / 1e3
                    t0 = graph_us(lambda x=x, w=w: torch.mm(w, x.t())) / 1e3
                    row = dict(shape=shape, proj=name, m=m, variant="swap", us=t * 1e3, us_without_copy=t0 * 1e3,
                               tflops=2 * m * n * k / t / 1e9, vs_cublas=base / t, rel_err=err)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                for sk in [int(x) for x in args.bmm.split(",") if x]:
                    for fp32 in (True, False):
                        name_ = f"bmm{sk}" + ("" if fp32 else "h")
                        try:
                            y = bmm_split(x, w, sk, fp32)
                            err = float((y.float() - ref.float()).norm() / ref.float().norm())
                            t = graph_us(lambda x=x, w=w, sk=sk, fp32=fp32: bmm_split(x, w, sk, fp32)) / 1e3
                            row = dict(shape=shape, proj=name, m=m, variant=name_, us=t * 1e3,
                                       tflops=2 * m * n * k / t / 1e9, vs_cublas=base / t, rel_err=err)
                        except Exception as e:  # noqa: BLE001 - a torch without bmm's out_dtype
                            row = dict(shape=shape, proj=name, m=m, variant=name_, error=repr(e)[:200])
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                for var in [v for v in args.sweep.split(";") if v != "-"]:
                    os.environ[CONFIG_ENV] = var
                    try:
                        cfg = op.config(x, w)
                        y = op(x, w)
                        if y is None:
                            row = dict(shape=shape, proj=name, m=m, variant=var or "rule", us=None, note="declined")
                        else:
                            err = float((y.float() - ref.float()).norm() / ref.float().norm())
                            t = graph_us(lambda x=x, w=w: op(x, w)) / 1e3
                            row = dict(shape=shape, proj=name, m=m, variant=var or "rule", cfg=cfg._asdict(),
                                       us=t * 1e3, tflops=2 * m * n * k / t / 1e9, vs_cublas=base / t, rel_err=err)
                    except Exception as e:  # a tile that does not compile (shared memory): next
                        row = dict(shape=shape, proj=name, m=m, variant=var, error=repr(e)[:200])
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    os.environ.pop(CONFIG_ENV, None)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

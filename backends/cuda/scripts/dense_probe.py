"""Probe: the fused decode ops (hwkv_cuda.decode_ops) against cuBLAS ``F.linear`` per projection of
Llama-3.2-1B, over a tile sweep, with and without programmatic dependent launch.

Each op is timed as CUDA-graph replays of a chain over distinct weight copies (a model streams its
layers: nothing stays in L2), each launch ordered after the previous one as in a forward.
Prints µs and TB/s of weight + activation bytes; writes dense-probe.json.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/dense_probe.py --out DIR [--m 1,4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from hwkv_cuda.decode_ops import CONFIG_ENV, TritonDecodeOps, choose_config
from hwkv_cuda.launch import PDL_ENV

# (name, N, K, copies): Llama-3.2-1B (hidden 2048, 32/8 heads of 64, intermediate 8192, vocab 128256)
SHAPES = [("qkv", 3072, 2048, 16), ("o_proj", 2048, 2048, 16), ("gate_up", 16384, 2048, 16),
          ("down", 2048, 8192, 16), ("lm_head", 128256, 2048, 2)]
H, HKV, D = 32, 8, 64
# --model: (shapes, H, HKV, D) of one rank; llama-8b-tp2 is a rank's shard of Llama-3-8B at tp=2 (hidden
# 4096, 32/8 heads of 128 -> 16/4, intermediate 14336 -> 7168, vocab 128256 -> 64128)
MODELS = {
    "llama-1b": (SHAPES, 32, 8, 64),
    "llama-8b": ([("qkv", 6144, 4096, 4), ("o_proj", 4096, 4096, 8), ("gate_up", 28672, 4096, 2),
                  ("down", 4096, 14336, 2), ("lm_head", 128256, 4096, 2)], 32, 8, 128),
    "llama-8b-tp2": ([("qkv", 3072, 4096, 8), ("o_proj", 4096, 2048, 16), ("gate_up", 14336, 4096, 4),
                      ("down", 4096, 7168, 4), ("lm_head", 64128, 4096, 2)], 16, 4, 128),
}


def time_graph(fn, per: int, reps: int = 20) -> float:
    """µs per op: ``fn`` runs ``per`` ops; captured once, replayed ``reps`` times."""
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
    return a.elapsed_time(b) * 1e3 / reps / per


class Case:
    def __init__(self, name: str, n: int, k: int, copies: int, m: int):
        dev, dt = "cuda", torch.bfloat16
        self.name, self.n, self.k, self.copies, self.m = name, n, k, copies, m
        self.ws = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
        k_in = 2 * k if name == "down" else k
        self.x = torch.randn(m, k_in, device=dev, dtype=dt)
        self.res = torch.randn(m, n, device=dev, dtype=dt)
        self.nw = torch.rand(k, device=dev, dtype=dt) + 0.5
        ang = torch.arange(4096, device=dev)[:, None] * (1.0 / 500000 ** (torch.arange(0, D, 2, device=dev) / D))
        ang = torch.cat([ang, ang], dim=-1)
        self.cos, self.sin = ang.cos().to(dt), ang.sin().to(dt)
        self.pos = torch.arange(m, device=dev) + 1000
        # Llama's GQA of 4: N = (4 + 2) x kv heads x D for the qkv shapes of every model here
        self.h, self.hkv = (4 * (n // (6 * D)), n // (6 * D)) if name == "qkv" else (H, HKV)
        self.kv = torch.zeros(64, 2, 16, self.hkv, D, device=dev, dtype=dt)
        self.slots = torch.arange(m, device=dev) + 100
        self.bytes = n * k * 2 + m * (n + k_in) * 2

    def fused(self, ops: TritonDecodeOps, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.name == "qkv":
            return ops.qkv(x, self.nw, 1e-5, w, None, self.cos, self.sin, self.pos, None, self.kv, self.slots,
                           self.h, self.hkv, D)
        if self.name == "o_proj":
            return ops.linear(x, w, None, self.res)
        if self.name == "down":
            return ops.silu_linear(x, w, None, self.res)
        return ops.norm_linear(x, self.nw, 1e-5, w, None)

    def chain(self, op) -> None:
        # stream order alone makes each launch wait for the previous one (gdc_wait, without PDL the
        # launch itself), as in a forward; the data need not flow
        for w in self.ws:
            op(w, self.x)

    def cublas(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x[:, : self.k], w)


def runs_as_named(cfg: dict, name: str, k: int) -> bool:
    """Whether the engine would launch ``cfg`` as labelled for this shape (no silent fallback, no tile wider than
    K, no preload of a tile too big for the registers)."""
    sk = cfg.get("split_k", 1)
    if cfg.get("stream"):  # the persistent GEMV: the whole K a tile, block_k and split_k unused
        return True
    if cfg["block_k"] > triton.next_power_of_2(k) or (cfg["preload"] and cfg["block_n"] * cfg["block_k"] > 16384):
        return False
    if cfg["preload"] == 2 and cfg["block_k"] >= k and sk == 1:  # one tile: the same as preload=1
        return False
    return sk == 1 or (name != "qkv" and cfg["preload"] != 1 and k % (sk * cfg["block_k"]) == 0)


def run(c: Case, row: dict, cfg: dict, pdl: str) -> None:
    """Time ``c``'s fused op under tile ``cfg`` with PDL on ("1") or off ("0"); append to ``row``."""
    os.environ[CONFIG_ENV] = ",".join(f"{k}={v}" for k, v in cfg.items())
    os.environ[PDL_ENV] = pdl
    ops = TritonDecodeOps()
    try:
        t = time_graph(partial(c.chain, partial(c.fused, ops)), c.copies)
    except Exception as e:  # a config may not compile
        print(f"{c.name} M={c.m} {cfg} pdl={pdl}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return
    row["configs"].append(dict(cfg, pdl=int(pdl), us=t, TBps=c.bytes / t / 1e6))


def main() -> None:
    global SHAPES, H, HKV, D
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--m", default="1")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--model", default="llama-1b", help=f"comma list of {sorted(MODELS)} (head size: the first's)")
    ap.add_argument("--quick", action="store_true", help="a 12-config sweep (block_n 4/8/16 x block_k 1024/2048 x "
                    "pipelined or preloaded, num_warps by block_n) instead of 36")
    ap.add_argument("--evict", action="store_true", help="also time the best three PDL tiles with evict-first weight "
                    "loads (evict=1)")
    ap.add_argument("--skip-nopdl", action="store_true", help="do not re-time the best three without PDL")
    ap.add_argument("--pick", default=None, help="write the fastest PDL config per shape here, as shell exports of "
                    "HWKV_CUDA_DENSE_CONFIG_<N>X<K> (only where it beats the engine's own choice by >= 3%%)")
    args = ap.parse_args()
    SHAPES = [s for name in args.model.split(",") for s in MODELS[name][0]]
    H, HKV, D = MODELS[args.model.split(",")[0]][1:]
    torch.manual_seed(0)
    res: dict = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                     triton=triton.__version__, model=args.model, rows=[])
    n = 1 << 28
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    res["copy_TBps"] = 2 * n / time_graph(lambda: [dst.copy_(src) for _ in range(16)], 16) / 1e6
    print(f"copy {res['copy_TBps']:.3f} TB/s", flush=True)
    sweep = [dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=st, preload=pre, evict=0)
             for bn, bk, wp, (st, pre) in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8), ((3, 0), (1, 1)))]
    if args.quick:
        sweep = [c for c in sweep if c["block_k"] != 512 and c["num_warps"] == (4 if c["preload"] else 8)]
    # K of 4096 / 8192 in one preloaded tile (every weight byte of a program in flight before the PDL wait)
    sweep += [dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=1, preload=1, evict=0)
              for bn, bk, wp in ((2, 4096, 4), (4, 4096, 4), (4, 4096, 8), (2, 8192, 8), (2, 8192, 4))]
    # one-tile shapes: fewer or more rows a program, fewer warps (every weight byte still in flight before the wait)
    sweep += [dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=1, preload=1, evict=0)
              for bn, bk, wp in ((2, 2048, 4), (2, 2048, 2), (4, 2048, 2), (8, 2048, 8), (16, 1024, 8))]
    # several K tiles (down): the first tile before the PDL wait, then the loop (preload=2)
    sweep += [dict(block_n=bn, block_k=bk, num_warps=8, num_stages=st, preload=2, evict=0)
              for bn, bk, st in ((4, 2048, 3), (8, 2048, 3), (4, 1024, 4), (8, 1024, 4), (16, 1024, 3))]
    # split-K (plain epilogues: o_proj, gate_up, down, lm_head): a row block's K over 2-4 programs, each's first tile
    # before the PDL wait, summed by the last to arrive
    sweep += [dict(block_n=bn, block_k=bk, num_warps=wp, num_stages=st, preload=2, evict=0, split_k=sk)
              for bn, bk, wp, st, sk in ((4, 2048, 8, 1, 4), (8, 2048, 8, 1, 4), (4, 1024, 8, 3, 4), (4, 2048, 8, 3, 2),
                                         (4, 1024, 4, 1, 2), (8, 1024, 8, 1, 2), (16, 1024, 8, 1, 2))]
    picks = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    order = args.shapes.split(",")  # in the order asked (a run cut by its time limit has the first)
    for name, N, K, copies in sorted((sh for sh in SHAPES if sh[0] in order), key=lambda sh: order.index(sh[0])):
        for m in map(int, args.m.split(",")):
            c = Case(name, N, K, copies, m)
            t_cublas = time_graph(partial(c.chain, c.cublas), copies)
            row = dict(shape=name, N=N, K=K, M=m, MB=c.bytes / 1e6, cublas_us=t_cublas,
                       cublas_TBps=c.bytes / t_cublas / 1e6, configs=[])
            default = choose_config(m, N, K)  # what the engine launches for this shape
            seen: list[dict] = []
            for cfg in [dict(default._asdict()), *sweep]:  # the sweep with PDL, then its best three without
                if cfg not in seen and runs_as_named(cfg, name, K):
                    seen.append(cfg)
                    run(c, row, cfg, "1")
            top3 = sorted(row["configs"], key=lambda r: r["us"])[:3]
            for r in top3 if args.evict else ():
                run(c, row, {k: v for k, v in r.items() if k not in ("pdl", "us", "TBps")} | {"evict": 1}, "1")
            for r in () if args.skip_nopdl else top3:
                run(c, row, {k: r[k] for k in sweep[0]}, "0")
            os.environ.pop(CONFIG_ENV, None)
            os.environ.pop(PDL_ENV, None)
            best = min(row["configs"], key=lambda r: r["us"])
            chosen = next((r for r in row["configs"] if r["pdl"] == 1 and all(
                r.get(f, 1 if f == "split_k" else 0) == getattr(default, f) for f in default._fields)), None)
            print(json.dumps(dict(shape=name, N=N, K=K, M=m, default=dict(default._asdict()),
                                  default_us=chosen and round(chosen["us"], 2))), flush=True)
            print(json.dumps(dict(shape=name, M=m, cublas_us=round(t_cublas, 2),
                                  cublas_TBps=round(row["cublas_TBps"], 3), best=best)), flush=True)
            for pdl in (1, 0):
                top = sorted((r for r in row["configs"] if r["pdl"] == pdl), key=lambda r: r["us"])[:3]
                print(f"  pdl={pdl} top3: " + "; ".join(
                    f"{r['block_n']}/{r['block_k']}/w{r['num_warps']}/s{r['num_stages']}/p{r['preload']}/e{r['evict']}"
                    f"/k{r.get('split_k', 1)} "
                    f"{r['us']:.2f}us" for r in top), flush=True)
            res["rows"].append(row)
            if chosen and best["pdl"] == 1 and best["us"] < 0.97 * chosen["us"]:
                picks.append(f"export {CONFIG_ENV}_{N}X{K}=" + ",".join(f"{f}={best[f]}" for f in best
                                                                           if f not in ("pdl", "us", "TBps"))
                             + f"  # {name}: {chosen['us']:.2f} -> {best['us']:.2f} us")
                print("picked: " + picks[-1], flush=True)
            if args.pick:  # after every shape: a run cut by its time limit keeps what it found
                Path(args.pick).write_text("".join(p + "\n" for p in picks))
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "dense-probe.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

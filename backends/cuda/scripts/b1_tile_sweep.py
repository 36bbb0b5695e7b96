"""Batch-1 decode tile sweep in ONE engine at the public defaults (``hwkv.Engine(model, backend="cuda", dtype=...)``,
no other argument), greedy per weight shape: for each shape in turn every candidate tile
(``HWKV_CUDA_DENSE_CONFIG_<N>X<K>``) is set over the winners so far, the batch-1 decode graphs are captured again, and
one graph replay's GPU time is measured (the min of ``--reps`` means of 20 replays, inputs pinned to 1 request of 384
keys: :func:`hwkv.bench.e2e_report.replay_ms`); a candidate is kept when it beats the shape's current tile by
``--keep``. Then the batch-1 measure (``hwkv bench e2e``'s :func:`hwkv.bench.e2e.batch1`: tok/s, MBU, step, replay) and
96 greedy tokens for main, the winners together, each winner alone, and main again. The sweep stops at ``--deadline``
seconds from the start (the final rows keep their time). Writes b1-tile-sweep.json.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/b1_tile_sweep.py --out DIR --deadline 100
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from b1_decode_ab import greedy_tokens, recapture  # this folder is on sys.path when run as a script
from stream_probe import compiled_report

import hwkv
from hwkv.bench.common import copy_bandwidth, model_dir
from hwkv.bench.e2e import batch1
from hwkv.bench.e2e_report import replay_ms

ENV = "HWKV_CUDA_DENSE_CONFIG_"
S = "block_k=2048,num_stages=1,evict=0"


def stream(bn: int, wp: int, pre: int, per: int, l2pf: int = 0, ev: int = 0) -> str:
    s = f"{S},block_n={bn},num_warps={wp},preload={pre},stream={per}" + (f",l2pf={l2pf}" if l2pf else "")
    return s.replace("evict=0", "evict=1") if ev else s


def dense(bn: int, bk: int, wp: int, st: int, pre: int, ev: int = 0) -> str:
    return f"block_n={bn},block_k={bk},num_warps={wp},num_stages={st},preload={pre},evict={ev},stream=0"


# Llama-3.2-1B's weight shapes [N, K] around main's tiles since session 9's batch 2 (gate_up, qkv, o_proj and the LM
# head on the persistent GEMV, kernels/dense.py dense_kernel_stream, balanced grid; down on dense_kernel): the bulk
# L2 prefetches (l2pf: 1 the first tile before the PDL wait, 2 also the next tile every iteration), evict-first where
# main's tile has it; down on the stream kernel with K in chunks
SWEEP: list[tuple[str, str, list[str]]] = [
    ("gate_up", "16384X2048", [stream(*c, ev=1) for c in (
        (8, 8, 0, 4, 1), (8, 8, 0, 4, 2), (8, 8, 0, 2, 2), (16, 8, 0, 3, 1), (4, 4, 0, 8, 2))]),
    ("lm_head", "128256X2048", [stream(*c, ev=1) for c in ((8, 8, 0, 4, 2), (4, 4, 0, 6, 2), (4, 4, 2, 6, 2))]),
    ("down", "2048X8192", [stream(*c, ev=1).replace("block_k=2048", f"block_k={bk}") for bk, c in (
        (2048, (4, 8, 0, 3, 2)), (2048, (4, 8, 0, 3)), (1024, (4, 8, 0, 4, 2)), (2048, (2, 4, 0, 6, 2)),
        (2048, (8, 8, 0, 2, 2)))]),  # K (8192) in chunks: the stream kernel's CHUNKED path
    ("qkv", "3072X2048", [stream(*c) for c in ((4, 4, 2, 6, 2), (4, 4, 0, 6, 1), (4, 8, 0, 4, 1), (8, 8, 0, 2, 1))]),
    ("o_proj", "2048X2048", [stream(*c, ev=1) for c in ((4, 4, 0, 4, 1), (4, 4, 2, 4, 2))]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cuda", help="cpu: a smoke run of the control flow (no graphs, replay 0)")
    ap.add_argument("--workdir", default="/dev/shm/hwkv-b1")
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--deadline", type=float, default=100.0, help="seconds from the start after which no candidate "
                    "is tried (the final rows run after it)")
    ap.add_argument("--final-s", type=float, default=28.0, help="seconds kept for the final rows")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", type=float, default=0.005, help="a candidate is kept when this much faster")
    ap.add_argument("--evict-rerun", type=int, default=3, help="each shape's fastest this many again evict-first")
    ap.add_argument("--set", default="1b", choices=["1b", "8b-tp2", "8b-tp2-dense"], help="the candidate set: "
                    "Llama-3.2-1B's shapes, or a tp=2 rank's of Llama-3-8B (tp_b1_sweep.SWEEP or SWEEP_DENSE; --model "
                    "llama-8b-tp2-rank)")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--rows", default="[]", help="JSON list of {name, env}: more final rows (batch-1 measure, tokens), "
                    "each over main's defaults")
    args = ap.parse_args()
    global SWEEP
    if args.set.startswith("8b-tp2"):
        import tp_b1_sweep

        SWEEP = tp_b1_sweep.SWEEP_DENSE if args.set.endswith("dense") else tp_b1_sweep.SWEEP
    args.shapes = args.shapes or ",".join(s[0] for s in SWEEP)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mdir = model_dir(argparse.Namespace(model=args.model, dtype=args.dtype, workdir=args.workdir))
    cfg = json.loads((mdir / "config.json").read_text())
    engine = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype)  # the public defaults: nothing else
    import torch

    host = args.backend == "cpu"
    bw = copy_bandwidth(engine.backend.device, 1 << 24 if host else 1 << 30)
    res: dict[str, Any] = dict(device="cpu" if host else torch.cuda.get_device_name(),
                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               commit=Path("COMMIT").read_text().strip() if Path("COMMIT").exists() else "",
                               engine_init_s=round(time.perf_counter() - t0, 1), copy_bw_TBps=bw / 1e12, trials=[],
                               winners={}, rows=[])
    print(f"[sweep] engine {res['engine_init_s']} s, copy {bw / 1e12:.3f} TB/s", flush=True)
    extra = json.loads(args.rows)
    keys = {ENV + k for _, k, _ in SWEEP} | {k for r in extra for k in r.get("env", {})}

    def apply(env: dict[str, str]) -> None:
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(env)
        recapture(engine)

    def replay(env: dict[str, str]) -> float:
        apply(env)
        return min(replay_ms(engine, 1, 128 + 256) or 0.0 for _ in range(args.reps))

    win: dict[str, str] = {}
    cur = replay(win)
    res["main_replay_ms"] = cur
    print(f"[sweep] main: replay {cur:.4f} ms", flush=True)
    stop = False
    for name, shape, cands in SWEEP:
        if name not in args.shapes.split(",") or stop:
            continue
        best = (cur, None)
        tried: list[tuple[float, str]] = []
        queue = [*cands, "EVICT"]
        while queue:
            c = queue.pop(0)
            if c == "EVICT":  # the shape's three fastest again with evict-first weight loads (main's gate_up has them)
                queue = [x.replace("evict=0", "evict=1") for _, x in sorted(tried)[:args.evict_rerun]
                         if "evict=0" in x]
                continue
            if time.perf_counter() - t0 > args.deadline - args.final_s:
                stop = True
                print("[sweep] deadline: no more candidates", flush=True)
                break
            try:
                t = replay({**win, ENV + shape: c})
            except Exception as e:  # a tile that does not compile or launch
                print(f"[sweep] {name} {c}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                res["trials"].append(dict(shape=name, cfg=c, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            res["trials"].append(dict(shape=name, cfg=c, replay_ms=t))
            tried.append((t, c))
            rel = (t / cur - 1) * 100 if cur else 0.0
            print(f"[sweep] {name} {c.removeprefix(S + ',')}: {t:.4f} ms ({rel:+.1f}%)", flush=True)
            if t < best[0]:
                best = (t, c)
        if best[1] is not None and best[0] < cur * (1 - args.keep):
            win[ENV + shape] = best[1]
            res["winners"][name] = dict(cfg=best[1], replay_ms=best[0], before_ms=cur)
            print(f"[sweep] KEEP {name}: {best[1]} {cur:.4f} -> {best[0]:.4f} ms", flush=True)
            cur = best[0]
        (out / "b1-tile-sweep.json").write_text(json.dumps(res, indent=1))
    variants = [("main", {})] + ([("winners", dict(win))] if win else []) + [(r["name"], r["env"]) for r in extra]
    if len(win) > 1:
        variants += [(f"{k.removeprefix(ENV)} alone", {k: v}) for k, v in win.items()]
    variants.append(("main (again)", {}))
    ref = None
    for name, env in variants:
        if name.endswith("alone") and time.perf_counter() - t0 > args.deadline:
            continue
        apply(env)
        row: dict[str, Any] = dict(name=name, env=env, run=batch1(engine, cfg, cfg["vocab_size"], 256, bw),
                                   tokens=greedy_tokens(engine, cfg["vocab_size"]))
        if ref is None:
            ref = row["tokens"]
        row["first_divergence"] = next((i for i, (a, b) in enumerate(zip(ref, row["tokens"])) if a != b), -1)
        r = row["run"]
        print(f"[sweep] {name}: {r['tok_per_s']:.0f} tok/s MBU {r['mbu']:.1%} step {r['step_ms']:.3f} ms replay "
              f"{r.get('gpu_replay_ms_last', float('nan')):.3f} ms; tokens vs main: first divergence "
              f"{row['first_divergence']}", flush=True)
        res["rows"].append(row)
        (out / "b1-tile-sweep.json").write_text(json.dumps(res, indent=1))
    if not host:  # registers, spills, shared memory, async copies of every GEMV variant compiled here
        try:
            res["compiled"] = compiled_report()
        except Exception as e:  # a report only: Triton's cache layout differs between versions
            res["compiled"] = f"{type(e).__name__}: {e}"
        (out / "b1-tile-sweep.json").write_text(json.dumps(res, indent=1))
    if win:
        print("[sweep] winners as exports: " + " ".join(f"{k}='{v}'" for k, v in win.items()), flush=True)


if __name__ == "__main__":
    main()

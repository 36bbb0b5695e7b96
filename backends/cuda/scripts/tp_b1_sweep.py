"""Batch-1 decode A/B at tensor parallelism in ONE engine per size (``hwkv.Engine(model, backend="cuda", dtype=...,
tensor_parallel_size=N)``, the arguments of ``hwkv bench tp``): each variant sets its ``HWKV_`` environment (tile
overrides ``HWKV_CUDA_DENSE_CONFIG_<N>X<K>``, kernel switches) on every rank and captures the batch-1 decode graphs
again (``DriverRunner.recapture``: the workers first, the capture's collectives pair up), then times batch-1 decode
as ``hwkv bench tp`` does (the step time from two runs of different output lengths, the min of ``--reps``) and takes
greedy tokens of ``--check`` prompts generated alone (the one-token path) against the first variant's.

``--sweep`` runs greedy per weight shape (each candidate over the winners so far, kept when ``--keep`` faster), then
the final rows: main, the winners together, each winner alone, main again. ``--rows`` adds rows of their own (JSON
list of {name, env}, each over main's defaults). Stops trying candidates at ``--deadline`` seconds from the start less
``--final-s``. Writes tp-b1-sweep.json.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/tp_b1_sweep.py --tp 2 --out DIR --deadline 120
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench.tp import _generate, _host_counters, _prompts

ENV = "HWKV_CUDA_DENSE_CONFIG_"
S = "block_k=4096,num_stages=1,evict=0"


def stream(bn: int, wp: int, pre: int, per: int, ev: int = 0, bk: int = 4096, l2pf: int = 0) -> str:
    """A persistent-GEMV tile (kernels/dense.py ``dense_kernel_stream``): rows, warps, preload, programs a SM."""
    s = f"{S},block_n={bn},num_warps={wp},preload={pre},stream={per}".replace("block_k=4096", f"block_k={bk}")
    s += f",l2pf={l2pf}" if l2pf else ""
    return s.replace("evict=0", "evict=1") if ev else s


def dense(bn: int, bk: int, wp: int, st: int, pre: int, ev: int = 0) -> str:
    return f"block_n={bn},block_k={bk},num_warps={wp},num_stages={st},preload={pre},evict={ev},stream=0"


# A rank's shard of Llama-3-8B at tp=2 (hidden 4096, 16/4 heads of 128, intermediate 7168, vocab 64128): the
# persistent GEMV around the 1B winners of session 9 (qkv 4/4/2/6, o_proj 4/4/2/4 evict, gate_up 8/8/0/4 evict,
# LM head 4/4/2/6 evict), whose shapes are of the same size as these
SWEEP: list[tuple[str, str, list[str]]] = [
    ("qkv", "3072X4096", [stream(4, 4, 2, 6), stream(8, 8, 2, 2)]),
    # down (K 7168): main's 8-row K loop has 32 KB a SM in flight (one program a SM); whole-K tiles of 2-4 rows from
    # 2-4 light programs a SM hold 100+ KB
    ("down", "4096X7168", [stream(4, 8, 2, 2, 1, 8192), stream(2, 4, 2, 4, 1, 8192)]),
    # gate_up and qkv follow an all-reduce: weights loaded (or sent toward L2) before the PDL wait hide some of it
    ("gate_up", "14336X4096", [stream(8, 8, 0, 4, 1), stream(8, 8, 2, 2, 1), stream(8, 8, 0, 4, 1, l2pf=1)]),
    ("o_proj", "4096X2048", [stream(4, 4, 2, 4, 1, 2048)]),
    ("lm_head", "64128X4096", [stream(4, 4, 2, 6, 1)]),
]

# dense_kernel (one program a row block) around main's per-rank tiles: the next K tile loaded during the current one's
# dot (preload=1: two tiles in flight a program), evict-first weights, wider row blocks; the persistent GEMV above lost
# at every per-rank shape on one H200 (llama-8b-tp2-rank, +1.7 to +11 %: its whole-K input row takes 148-228
# registers a thread, main's 8-row tiles 64-76)
SWEEP_DENSE: list[tuple[str, str, list[str]]] = [
    ("gate_up", "14336X4096", [dense(8, 2048, 8, 1, 1), dense(8, 2048, 8, 3, 0, 1), dense(16, 2048, 8, 3, 0)]),
    ("down", "4096X7168", [dense(8, 2048, 8, 1, 1), dense(8, 2048, 8, 3, 0, 1), dense(16, 1024, 8, 3, 0),
                           dense(4, 2048, 8, 3, 2)]),
    ("qkv", "3072X4096", [dense(8, 2048, 8, 1, 1), dense(4, 4096, 8, 1, 1)]),
    ("o_proj", "4096X2048", [dense(4, 2048, 4, 1, 1), dense(8, 2048, 8, 1, 1)]),
    ("lm_head", "64128X4096", [dense(8, 2048, 8, 3, 0, 1)]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cuda", help="cpu: a smoke run of the control flow (gloo, no graphs)")
    ap.add_argument("--workdir", default="/dev/shm/hwkv-models")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--decode", default="16,272", help="two output lengths of the batch-1 runs")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--check", type=int, default=2, help="prompts whose 32 greedy tokens are compared (alone)")
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--final-s", type=float, default=30.0, help="seconds kept for the final rows")
    ap.add_argument("--keep", type=float, default=0.005)
    ap.add_argument("--sweep", default="", help="comma list of shapes to sweep greedily ('' none; 'all')")
    ap.add_argument("--set", default="dense", choices=["dense", "stream"], help="the candidates: SWEEP_DENSE (main's "
                    "dense_kernel tiles varied) or SWEEP (the persistent GEMV: lost at every per-rank shape, one GPU)")
    ap.add_argument("--rows", default="[]", help="JSON list of {name, env[, over_winners]}: rows over main's defaults "
                    "(over the sweep's winners with over_winners true)")
    ap.add_argument("--second-env", default="", help="JSON {VAR: VALUE}: then a second engine started with this "
                    "environment (read at start-up), main and the winners again")
    ap.add_argument("--second-s", type=float, default=45.0, help="seconds the second engine needs (skipped when "
                    "fewer are left of --total-s)")
    ap.add_argument("--total-s", type=float, default=1e9, help="seconds this script may take in all")
    ap.add_argument("--final2-s", type=float, default=12.0, help="seconds kept for the second engine's last row")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from hwkv.bench.common import model_dir

    mdir = model_dir(argparse.Namespace(model=args.model, dtype=args.dtype, workdir=args.workdir))
    vocab = json.loads((mdir / "config.json").read_text())["vocab_size"]
    engine = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype, max_model_len=args.max_model_len,
                         tensor_parallel_size=args.tp)
    from hwkv.engine.tp.runner import recapture

    rc = getattr(engine.runner, "recapture", None) or partial(recapture, engine.runner)
    res: dict[str, Any] = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), tp=args.tp,
                               commit=Path("COMMIT").read_text().strip() if Path("COMMIT").exists() else "",
                               engine_init_s=round(time.perf_counter() - t0, 1), trials=[], winners={}, rows=[])
    print(f"[tpsweep] tp={args.tp} engine up in {res['engine_init_s']} s", flush=True)
    short, long = (int(x) for x in args.decode.split(","))
    prompt = _prompts(1, 32, vocab, 1)
    checked = _prompts(args.check, 24, vocab, 3)
    extra = json.loads(args.rows)
    cands = SWEEP_DENSE if args.set == "dense" else SWEEP
    keys = {ENV + k for _, k, _ in cands} | {k for r in extra for k in r.get("env", {})}

    def apply(env: dict[str, str]) -> None:
        rc(0, 1, {k: env.get(k, "") for k in keys | set(env)})

    host: dict[str, float] = {}

    def step_ms(env: dict[str, str]) -> float:
        """The batch-1 step (ms, best of --reps) as hwkv bench tp; the driver's host work per step of that rep in
        host["ms"] (its time in Engine.step less its waits for sampled tokens, the same difference)."""
        apply(env)
        _generate(engine, prompt, short)  # warm
        best = float("inf")
        for _ in range(args.reps):
            c0 = _host_counters(engine)
            ts, _ = _generate(engine, prompt, short)
            c1 = _host_counters(engine)
            tl, _ = _generate(engine, prompt, long)
            c2 = _host_counters(engine)
            ms = (tl - ts) / (long - short) * 1e3
            if ms < best:
                steps = (c2[2] - c1[2]) - (c1[2] - c0[2])
                work = (c2[0] - c1[0]) - (c1[0] - c0[0]) - (c2[1] - c1[1]) + (c1[1] - c0[1])
                host["ms"] = work / max(steps, 1) * 1e3
                best = ms
        return best

    def save() -> None:
        (out / "tp-b1-sweep.json").write_text(json.dumps(res, indent=1))

    def sweep(todo: list[tuple[str, str, list[str]]], win: dict[str, str], cur: float,
              until: float) -> tuple[float, list[tuple[str, str, list[str]]]]:
        """Greedy over ``todo``'s shapes (``win`` grows in place); returns the step with the winners and the shapes
        not finished by ``until`` (seconds from the start)."""
        for i, (name, shape, cands) in enumerate(todo):
            best = (cur, None)
            for c in cands:
                if time.perf_counter() - t0 > until:
                    print("[tpsweep] deadline: no more candidates", flush=True)
                    return cur, todo[i:]
                try:
                    t = step_ms({**win, ENV + shape: c})
                except Exception as e:  # a tile that does not compile or launch
                    print(f"[tpsweep] {name} {c}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    res["trials"].append(dict(shape=name, cfg=c, error=f"{type(e).__name__}: {e}"[:300]))
                    save()
                    continue
                res["trials"].append(dict(shape=name, cfg=c, step_ms=t, over=dict(win)))
                print(f"[tpsweep] {name} {c}: {t:.4f} ms ({(t / cur - 1) * 100:+.1f}%)", flush=True)
                if t < best[0]:
                    best = (t, c)
                save()
            if best[1] is not None and best[0] < cur * (1 - args.keep):
                win[ENV + shape] = best[1]
                res["winners"][name] = dict(cfg=best[1], step_ms=best[0], before_ms=cur)
                print(f"[tpsweep] KEEP {name}: {best[1]} {cur:.4f} -> {best[0]:.4f} ms", flush=True)
                cur = best[0]
            save()
        return cur, []

    ref: list[list[int]] = []

    def row(name: str, env: dict[str, str], tag: dict[str, str] | None = None) -> float | None:
        """One row: the step, the driver's host work, greedy tokens of the checked prompts alone against main's."""
        try:
            ms = step_ms(env)
            toks = [_generate(engine, [p], 32)[1][0] for p in checked]
        except Exception as e:
            print(f"[tpsweep] row {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            res["rows"].append(dict(name=name, env=env, error=f"{type(e).__name__}: {e}"[:300]))
            save()
            return None
        if not ref:
            ref.extend(toks)
        div = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), -1) for x, y in zip(ref, toks)]
        res["rows"].append(dict(name=name, env={**(tag or {}), **env}, step_ms=ms, tok_per_s=1e3 / ms,
                                host_ms=host.get("ms"), tokens=toks, first_divergence=div))
        print(f"[tpsweep] {name}: {ms:.4f} ms a step ({1e3 / ms:.1f} tok/s), driver host {host.get('ms', 0):.3f} ms; "
              f"tokens vs main: first divergence {div}", flush=True)
        save()
        return ms

    second = json.loads(args.second_env) if args.second_env else {}
    win: dict[str, str] = {}
    todo = [s for s in cands if args.sweep == "all" or s[0] in args.sweep.split(",")]
    cur = step_ms(win) if todo else 0.0
    res["main_step_ms"] = cur
    print(f"[tpsweep] main: {cur:.4f} ms a step", flush=True)
    cur, left = sweep(todo, win, cur, args.deadline - args.final_s)
    rows = [("main", {})] + ([("winners", dict(win))] if win else []) + [
        (r["name"], {**(win if r.get("over_winners") else {}), **r["env"]}) for r in extra]
    if len(win) > 1 and not second:
        rows += [(f"{k.removeprefix(ENV)} alone", {k: v}) for k, v in win.items()]
    rows.append(("main (again)", {}))
    for name, env in rows:
        if name.endswith("alone") and time.perf_counter() - t0 > args.deadline:
            continue
        row(name, env)
    if win:
        print("[tpsweep] winners as exports: " + " ".join(f"{k}='{v}'" for k, v in win.items()), flush=True)
    t1 = time.perf_counter()
    engine.close()
    print(f"[tpsweep] closed in {time.perf_counter() - t1:.1f} s; total {time.perf_counter() - t0:.1f} s", flush=True)
    if second and args.total_s - (time.perf_counter() - t0) < args.second_s:
        print("[tpsweep] no time left for the second engine", flush=True)
        second = {}
    if second:  # another engine with an environment read at start-up (every rank inherits it): main and the winners,
        # then the shapes the first engine had no time for, over the winners
        os.environ.update(second)
        t2 = time.perf_counter()
        engine = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype, max_model_len=args.max_model_len,
                             tensor_parallel_size=args.tp)
        rc = getattr(engine.runner, "recapture", None) or partial(recapture, engine.runner)
        res["second_env"], res["second_init_s"] = second, round(time.perf_counter() - t2, 1)
        print(f"[tpsweep] second engine ({second}) up in {res['second_init_s']} s", flush=True)
        tag = " [" + " ".join(f"{k}={v}" for k, v in second.items()) + "]"
        row("main" + tag, {}, second)
        cur2 = row("winners" + tag, dict(win), second) if win else None
        if left and cur2:
            n = len(win)
            _, left = sweep(left, win, cur2, args.total_s - args.final2_s)
            if len(win) > n:
                row("winners, all" + tag, dict(win), second)
                print("[tpsweep] winners as exports: " + " ".join(f"{k}='{v}'" for k, v in win.items()), flush=True)
        engine.close()
        print(f"[tpsweep] total {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()

"""#36 (helper host): where a batch-1 decode step's time goes beyond its graph replay, and an A/B of the greedy
sampler inside the decode graphs, in ONE engine at the public defaults (``hwkv.Engine(model, backend="cuda",
dtype=...)``, no other argument).

Variants (the small decode graphs, every seq-len bucket, captured again for each; nothing else changes):
``graph2`` - the default: the greedy argmax runs inside the graph and feeds the next step's ids, two sets of graphs
and buffers take turns, a steady step's inputs go over on a side stream while the previous step runs
(hwkv/engine/graph_runner.py); ``graph1`` - the argmax inside, one set (inputs copied between two replays);
``host`` - the graphs without it (the sampler's argmax launched after the replay, the next step's ids copied in by a
device-side fill: the path before this change). Per variant: greedy tokens of a fixed
prompt (must be equal), ``hwkv bench e2e``'s batch-1 measure (:func:`hwkv.bench.e2e.batch1`) twice, the wall time of
every ``engine.step()`` of a 300-token decode (median / mean / p90 / p99 / max: jitter vs a fixed cost), and a
torch.profiler trace (CUDA activity only) of 200 steady steps: per step (token read-back to token read-back) its
span, GPU busy and idle time, the idle time by the pair of operations around each gap, and the operations outside
the replay's kernels (copies, sampler) by name. The ``graph2`` variant runs again at the end, then once more after
``gc.freeze()`` (whether Python's collector stalls the host). The offline workload (256 x 512 -> 256, greedy,
once warm, as ``hwkv bench defaults``) runs in the first ``graph2`` and the ``host`` variant: large batches must not
lose.

    PYTHONPATH=.:backends/cuda python3 bench/gpu/host_step_gaps.py --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

import hwkv
from hwkv.bench.common import copy_bandwidth, model_dir, workload
from hwkv.bench.e2e import batch1, run_engine
from hwkv.sampling_params import SamplingParams


def set_variant(engine: Any, name: str) -> float:
    """Capture the small decode graphs (1, 2, 4, 8 requests, every seq-len bucket) of the first set again for
    variant ``name``: ``graph2`` - the greedy argmax inside, two sets taking turns (the default); ``graph1`` - the
    argmax inside, one set; ``host`` - no argmax inside, one set (the path before)."""
    r = engine.runner
    a = r.graphs
    if not hasattr(r, "_bench_b"):
        r._bench_b = r.graphs_b
    b = r._bench_b
    a.sample = None if name.startswith("host") else r._greedy
    pingpong = name.startswith("graph2") and b is not None
    a.feed(b if pingpong else a)
    r.graphs_b = b if pingpong else None
    t0 = time.perf_counter()
    with torch.inference_mode():
        a.capture(pool=a.pool, batches={1, 2, 4, 8})
    return time.perf_counter() - t0


def greedy_tokens(engine: Any, vocab: int, n: int = 96) -> list[int]:
    prompt = workload(1, 128, 128, vocab, seed=11)[0][0]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)]
    engine.generate([prompt], params, use_tqdm=False)
    return list(engine.generate([prompt], params, use_tqdm=False)[0].token_ids)


def step_walls(engine: Any, vocab: int, n: int = 300) -> dict[str, Any]:
    """Wall ms of every ``engine.step()`` of one request's steady decode (first 8 and last 2 steps left out), the
    host's own work per step (wall less its wait for the sampled tokens), and Python's collections meanwhile (count and
    ms per generation)."""
    prompt = workload(1, 128, 128, vocab, seed=12)[0][0]
    engine.add_request("walls", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    ts, own = [], []
    counts, ms, t_gc = [0, 0, 0], [0.0, 0.0, 0.0], [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            t_gc[0] = time.perf_counter()
        else:
            counts[info["generation"]] += 1
            ms[info["generation"]] += (time.perf_counter() - t_gc[0]) * 1e3

    gc.callbacks.append(on_gc)
    r = engine.runner
    try:
        while engine.has_unfinished():
            w0, t0 = r.token_wait_s, time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t0
            ts.append(dt * 1e3)
            own.append((dt - (r.token_wait_s - w0)) * 1e3)
    finally:
        gc.callbacks.remove(on_gc)
    ts, own = sorted(ts[8:-2]), sorted(own[8:-2])
    k = len(ts)
    return dict(steps=k, median_ms=round(ts[k // 2], 4), mean_ms=round(sum(ts) / k, 4),
                p90_ms=round(ts[int(k * 0.9)], 4), p99_ms=round(ts[int(k * 0.99)], 4), max_ms=round(ts[-1], 4),
                over_1ms=sum(t > 1.0 for t in ts), host_own_median_ms=round(own[k // 2], 4),
                host_own_p90_ms=round(own[int(k * 0.9)], 4), gc_counts=counts, gc_ms=[round(x, 3) for x in ms])


def trace(engine: Any, vocab: int, steps: int = 200) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    prompt = workload(1, 128, 128, vocab, seed=13)[0][0]
    run_engine(engine, [(prompt, 8)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_engine(engine, [(prompt, steps)])
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    d2h = [i for i, e in enumerate(evs) if "DtoH" in e[2]]
    periods = list(zip(d2h[10:-3], d2h[11:-2]))  # steady steps: read-back to read-back
    if not periods:
        return dict(events=len(evs), d2h=len(d2h))
    spans, idles, by_gap, outside = [], [], {}, {}
    graph_names = {"dense_kernel", "attention_kernel"}
    for a, b in periods:
        seg = evs[a:b]
        start, end = seg[0][0], evs[b][0]
        busy, front, prev = 0.0, start, seg[0][2]
        for s, e, name in seg:
            if s > front + 0.05:
                key = f"{prev[:40]} -> {name[:40]}"
                by_gap[key] = by_gap.get(key, 0.0) + (s - front)
            busy += max(0.0, e - max(s, front))
            if e > front:
                front, prev = e, name
        spans.append(end - start)
        idles.append(end - start - busy)
        for s, e, name in seg:
            if name not in graph_names:
                outside.setdefault(name[:60], []).append(e - s)
    n = len(periods)
    spans.sort()
    mid = periods[n // 2][0]
    window = [dict(name=name[:50], t_us=round(s - evs[mid][0], 2), dur_us=round(e - s, 2))
              for s, e, name in evs[max(0, mid - 6): mid + 8]]
    return dict(steps=n, span_us_median=round(spans[n // 2], 2), span_us_mean=round(sum(spans) / n, 2),
                idle_us_mean=round(sum(idles) / n, 2),
                idle_by_gap_us_per_step={k: round(v / n, 2)
                                         for k, v in sorted(by_gap.items(), key=lambda kv: -kv[1])[:14]},
                non_gemv_ops={k: dict(per_step=round(len(v) / n, 2), mean_us=round(sum(v) / len(v), 2))
                              for k, v in sorted(outside.items(), key=lambda kv: -sum(kv[1]))[:16]},
                around_readback=window)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", default="graph2,host,graph1,graph2,graph2-gcfreeze")
    ap.add_argument("--trace", default="graph2,host,graph1")
    ap.add_argument("--offline", default="graph2,host", help="variants that also time the offline workload")
    ap.add_argument("--offline-shape", default="256,512,256", help="requests, input, output tokens")
    ap.add_argument("--backend", default="cuda", help="cuda, or graph-cpu (a CPU smoke run of this script)")
    ap.add_argument("--engine-args", default="{}", help="JSON Engine kwargs (the GPU run passes none)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mdir = model_dir(args)
    cfg = json.loads((Path(mdir) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    from hwkv.bench.common import backend

    if args.backend == "graph-cpu":
        from hwkv.reference.graphs import GraphCpuBackend

        be = GraphCpuBackend()
    else:
        be = backend(args.backend)
    bw = copy_bandwidth(be.device, 1 << 20 if args.backend == "graph-cpu" else 1 << 30)
    t0 = time.perf_counter()
    engine = hwkv.Engine(str(mdir), backend=be, dtype=args.dtype, **json.loads(args.engine_args))
    res: dict[str, Any] = dict(engine_init_s=time.perf_counter() - t0, copy_bw_TBps=bw / 1e12, rows=[])
    print(f"[host] engine in {res['engine_init_s']:.1f} s; copy bw {bw / 1e12:.3f} TB/s", flush=True)
    run_engine(engine, [(workload(1, 128, 128, vocab, seed=1)[0][0], 64)])
    want = None
    traced: set[str] = set()
    for v in args.variants.split(","):
        if v in ("offline", "collect", "freeze"):  # actions between variants (--variants)
            t0 = time.perf_counter()
            if v == "offline":  # the offline workload once, prompts not seen before (no prefix hits)
                n, n_in, n_out = (int(x) for x in args.offline_shape.split(","))
                seed = len(res["rows"]) + 20
                off = run_engine(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=seed)])
                res["rows"].append(dict(action=v, offline=off))
            else:
                gc.collect()
                if v == "freeze":
                    gc.freeze()
                res["rows"].append(dict(action=v))
            print(f"[host] {v} ({time.perf_counter() - t0:.2f} s)", flush=True)
            continue
        if v.endswith("gcfreeze"):
            gc.collect()
            gc.freeze()
        row: dict[str, Any] = dict(variant=v, recapture_s=round(set_variant(engine, v), 3))
        toks = greedy_tokens(engine, vocab)
        want = toks if want is None else want
        row["tokens_equal_first"] = toks == want
        row["batch1"] = [batch1(engine, cfg, vocab, 256, bw) for _ in range(2)]
        row["step_walls"] = step_walls(engine, vocab)
        if v in args.offline.split(","):  # the large batches must not lose: the offline workload, once warm
            n, n_in, n_out = (int(x) for x in args.offline_shape.split(","))
            run_engine(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=6)])
            row["offline"] = run_engine(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=5)])
        base = v.split("-")[0]
        if base in args.trace.split(",") and base not in traced:
            traced.add(base)
            row["trace"] = trace(engine, vocab)
        res["rows"].append(row)
        b1 = "; ".join("{:.1f} tok/s (step {:.4f} ms, replay {:.4f}, MBU {:.1%})".format(
            x["tok_per_s"], x["step_ms"], x.get("gpu_replay_ms_last", 0.0), x.get("mbu", 0.0)) for x in row["batch1"])
        print(f"[host] {v}: tokens equal {row['tokens_equal_first']}; batch-1 {b1}; step walls {row['step_walls']}",
              flush=True)
        if "offline" in row:
            print(f"[host]   offline {args.offline_shape}: {row['offline']['tok_per_s']:.0f} tok/s in "
                  f"{row['offline']['seconds']:.3f} s", flush=True)
        if "trace" in row:
            print(f"[host]   trace {json.dumps(row['trace'])}", flush=True)
        (out / "host_step_gaps.json").write_text(json.dumps(res, indent=1, default=str))
    print("[host] done", flush=True)


if __name__ == "__main__":
    main()

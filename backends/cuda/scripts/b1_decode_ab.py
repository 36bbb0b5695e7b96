"""Batch-1 decode A/B in ONE engine at the public defaults (``hwkv.Engine(model, backend="cuda", dtype=...)``, no
other argument): each variant sets its environment (tile overrides such as ``HWKV_CUDA_DENSE_CONFIG_<N>X<K>``) and
weight-prefetch hooks, captures the batch-1 decode graphs again (every seq-len bucket; nothing else is touched),
and runs ``hwkv bench e2e``'s batch-1 measure (:func:`hwkv.bench.e2e.batch1`: steady decode tok/s, MBU against the
copy bandwidth measured in the same run, one graph replay's GPU ms). The first variant runs again at the end
(drift). Optionally (``--trace``) one variant's steps under torch.profiler: every CUDA kernel and copy of 32 steady
steps (what runs outside the graph replay, and the GPU's idle time between replays), and the replay's critical
path per kernel label (:func:`hwkv.bench.timeline.graph_timeline`).

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/b1_decode_ab.py --out DIR \\
        --variants '[{"name": "base"}, {"name": "pf", "prefetch": 1}, {"name": "t", "env": {"HWKV_CUDA_...": "..."}}]'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from offline_ab import recapture as recapture_range  # this folder is on sys.path when run as a script

import hwkv
from hwkv.bench.common import copy_bandwidth, model_dir, workload
from hwkv.bench.e2e import batch1, run_engine
from hwkv.bench.e2e_report import profile
from hwkv.bench.timeline import graph_timeline


def recapture(engine: Any, batch: int = 1) -> int:
    """Capture the decode graphs of ``batch`` requests again, so that tile overrides and hooks set since take
    effect (offline_ab.recapture: the same capture for a range of batch sizes)."""
    return recapture_range(engine, batch - 1, batch)


def greedy_tokens(engine: Any, vocab: int, n: int = 96) -> list[int]:
    """``n`` greedy tokens of a fixed 128-token prompt (batch 1, the decode graphs), from the second of two runs: the
    first fills the prefix cache, so every variant's compared run hits it alike (a cold run computes the first
    token in the prefill, a warm one in a one-token step: other rounding, other tokens on a random-weight model)."""
    from hwkv.sampling_params import SamplingParams

    prompt = workload(1, 128, 128, vocab, seed=11)[0][0]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)]
    engine.generate([prompt], params, use_tqdm=False)
    return list(engine.generate([prompt], params, use_tqdm=False)[0].token_ids)


def step_trace(engine: Any, vocab: int, steps: int = 32) -> dict[str, Any]:
    """CUDA time by kernel/copy name over ``steps`` batch-1 decode steps (torch.profiler), and the span and GPU
    idle time of the trace's steady part, per step."""
    from torch.profiler import ProfilerActivity, profile

    prompt = workload(1, 128, 128, vocab, seed=4)[0][0]
    run_engine(engine, [(prompt, 8)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_engine(engine, [(prompt, steps + 1)])
    evs = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    by: dict[str, list[float]] = {}
    for a, b, name in evs:
        by.setdefault(name[:90], []).append(b - a)
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:24]
    # the steady part: the last `steps // 2` steps' worth of the trace (the prefill and first steps left out)
    half = evs[len(evs) // 2:]
    span = half[-1][1] - half[0][0]
    busy, end = 0.0, half[0][0]
    for a, b, _ in half:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return dict(steps=steps, span_us_second_half=span, idle_us_second_half=span - busy,
                kernels=[dict(name=k, count=len(v), total_us=round(sum(v), 1), mean_us=round(sum(v) / len(v), 2))
                         for k, v in top])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default="/dev/shm/hwkv-b1")
    ap.add_argument("--tokens", type=int, default=256, help="batch-1 decode length per measure")
    ap.add_argument("--repeat", type=int, default=2, help="measures per variant")
    ap.add_argument("--variants", default='[{"name": "base"}]', help="JSON list of {name, env, attrs, prefetch}: "
                    "environment, module constants ('hwkv.engine.graph_runner.IDS_WHOLE_BYTES'), prefetch hooks on")
    ap.add_argument("--trace", default="", help="names of variants to trace (comma list)")
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    variants = json.loads(args.variants)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mdir = model_dir(argparse.Namespace(model=args.model, dtype=args.dtype, workdir=args.workdir))
    cfg = json.loads((mdir / "config.json").read_text())
    t0 = time.perf_counter()
    engine = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype)  # the public defaults: nothing else
    dev = engine.backend.device
    host = dev.torch_device.type == "cpu"
    res: dict[str, Any] = dict(device="cpu" if host else torch.cuda.get_device_name(),
                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               commit=os.environ.get("COMMIT") or (Path("COMMIT").read_text().strip()
                                                                  if Path("COMMIT").exists() else ""), model=args.model,
                               engine_init_s=time.perf_counter() - t0, rows=[])
    bw = copy_bandwidth(dev, 1 << 24 if host else 1 << 30)
    res["copy_bw_TBps"] = bw / 1e12
    print(f"[b1ab] engine {res['engine_init_s']:.1f} s, copy {bw / 1e12:.3f} TB/s", flush=True)
    base_env = {k: os.environ.get(k) for v in variants for k in v.get("env", {})}
    base_attrs = {k: getattr(importlib.import_module(k.rpartition(".")[0]), k.rpartition(".")[2])
                  for v in variants for k in v.get("attrs", {})}
    for v in variants + [dict(variants[0], name=variants[0]["name"] + " (again)")]:
        for k, val in base_env.items():  # each variant starts from the process's own environment
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        os.environ.update({k: str(x) for k, x in v.get("env", {}).items()})
        for k, val in {**base_attrs, **v.get("attrs", {})}.items():  # module constants (e.g. graph_runner's)
            setattr(importlib.import_module(k.rpartition(".")[0]), k.rpartition(".")[2], val)
        engine.model.set_prefetch(*((dev.prefetch, dev.join_prefetch) if v.get("prefetch") and not host else ()))
        t1 = time.perf_counter()
        try:
            n = recapture(engine)
            row: dict[str, Any] = dict(name=v["name"], env=v.get("env", {}), attrs=v.get("attrs", {}),
                                       prefetch=bool(v.get("prefetch")),
                                       graphs=n, capture_s=round(time.perf_counter() - t1, 2), runs=[])
            for _ in range(args.repeat):
                row["runs"].append(batch1(engine, cfg, cfg["vocab_size"], args.tokens, bw))
            row["tokens"] = greedy_tokens(engine, cfg["vocab_size"])
        except Exception as e:  # a variant that fails is reported, the others still run
            print(f"[b1ab] {v['name']}: {type(e).__name__}: {e}", flush=True)
            res["rows"].append(dict(name=v["name"], error=f"{type(e).__name__}: {e}"))
            continue
        best = max(row["runs"], key=lambda r: r["tok_per_s"])
        ref = res["rows"][0].get("tokens") if res["rows"] else None
        if ref is not None:  # greedy tokens against the first variant's (first differing position, -1: none)
            row["first_divergence"] = next((i for i, (a, b) in enumerate(zip(ref, row["tokens"])) if a != b), -1)
        print(f"[b1ab] {v['name']}: " + "; ".join(
            f"{r['tok_per_s']:.0f} tok/s MBU {r['mbu']:.1%} step {r['step_ms']:.3f} ms replay "
            f"{r.get('gpu_replay_ms_last', float('nan')):.3f} ms" for r in row["runs"])
            + f" (capture {row['capture_s']} s; tokens vs the first variant: first divergence "
            f"{row.get('first_divergence', '-')})", flush=True)
        row["best"] = best
        res["rows"].append(row)
        if v["name"] in args.trace.split(",") and not host:  # the CUDA profiler: not on a CPU smoke run
            row["trace"] = step_trace(engine, cfg["vocab_size"])
            row["timeline"] = graph_timeline(engine, 1, 128 + args.tokens)
            row["host_phases_ms"] = profile(engine, cfg["vocab_size"], 1, steps=64)
            print(f"[b1ab]   host phases (ms per step): {row['host_phases_ms']}", flush=True)
            tr, tl = row["trace"], row["timeline"]
            print(f"[b1ab]   trace: second half span {tr['span_us_second_half']:.0f} us, GPU idle "
                  f"{tr['idle_us_second_half']:.0f} us over {tr['steps'] // 2} steps", flush=True)
            for k in tr["kernels"][:16]:
                print(f"[b1ab]     {k['count']:5d} x {k['mean_us']:8.2f} us  {k['name']}", flush=True)
            print(f"[b1ab]   replay critical path (us): {tl.get('critical_us')}; span {tl.get('span_us')}, idle "
                  f"{tl.get('idle_us')}", flush=True)
        (out / "b1-decode-ab.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

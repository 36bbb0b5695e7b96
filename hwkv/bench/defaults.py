"""`hwkv bench defaults`: what a user gets from the public API with default arguments.

``hwkv.Engine(model, backend=..., dtype=...)`` and nothing else unless ``--engine-args`` says so (every
such argument is printed next to the figures), then:

* **offline**: ``--num-requests`` × ``--input-len`` → ``--output-len`` greedy tokens (ignore_eos) through
  ``generate``, timed after an untimed pass of the same shape with other tokens, against the roofline
  of :mod:`hwkv.bench.roofline` (copy bandwidth and matmul rate measured in the same run);
* **batch 1**: steady decode tok/s and MBU (weights + mean KV bytes per step / step time / copy
  bandwidth), as ``hwkv bench e2e`` part b;
* optional ``--profile``: a torch.profiler table of one timed offline pass (CUDA time per kernel name
  and host time per step), then the decode step at the offline batch and at batch 1 taken apart: wall
  time per step by host phase against the GPU time of one graph replay (host-bound or not), and each
  kernel's share of the replay's critical path (:func:`hwkv.bench.timeline.graph_timeline`), to see
  where the gap to the roofline goes.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hwkv.bench.common import (
    copy_bandwidth,
    decode_read_bytes,
    engine_bench,
    free_engine,
    resolved,
    result_path,
    workload,
    write_result,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b", help="a local HF dir or a bench shape (llama-1b, llama-8b, ...)")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--b1-tokens", type=int, default=512, help="batch-1 decode length (0: skip)")
    p.add_argument("--engine-args", default="{}", help="JSON dict of Engine kwargs (default: none at all)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table of one offline pass")
    p.add_argument("--out", default=None)


def run(args: argparse.Namespace) -> int:
    import torch

    import hwkv
    from hwkv.bench.e2e import batch1, kv_bytes_per_token, run_engine
    from hwkv.bench.roofline import linear_params, matmul_rate, offline_roofline

    eb = engine_bench(args)
    mdir, cfg, be, dev, extra = eb.model_dir, eb.config, eb.backend, eb.device, eb.engine_args
    host = dev.torch_device.type == "cpu"
    res: dict[str, Any] = eb.header("defaults", args, non_default_engine_args=extra)
    print(f"[defaults] {args.model}: non-default engine arguments: {extra or 'none'}", flush=True)
    bw = copy_bandwidth(dev, 1 << 24 if host else 1 << 30)
    rate = matmul_rate(dev, getattr(torch, args.dtype), n=256 if host else 8192)
    res.update(copy_bw_TBps=bw / 1e12, matmul_TFLOPs=rate / 1e12)
    t0 = time.perf_counter()
    engine = hwkv.Engine(str(mdir), backend=be, dtype=args.dtype, **extra)
    res["engine_init_s"] = time.perf_counter() - t0
    res["resolved"] = resolved(engine)
    print(f"[defaults] resolved: {res['resolved']}", flush=True)
    n, n_in, n_out, vocab = args.num_requests, args.input_len, args.output_len, cfg["vocab_size"]
    run_engine(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=6)])  # compiles, other tokens
    work = [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=5)]
    wait0, steps0 = getattr(engine.runner, "token_wait_s", 0.0), engine.stats()["num_steps"]
    r = run_engine(engine, work)
    # the host's wait for sampled tokens: near 0 means the GPU waits for the host (host-bound steps)
    r["token_wait_s"] = getattr(engine.runner, "token_wait_s", 0.0) - wait0
    r["steps"] = engine.stats()["num_steps"] - steps0
    body, head = linear_params(engine.model)
    kv = kv_bytes_per_token(cfg, torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    roof = offline_roofline(cfg, body, head, decode_read_bytes(engine.model), kv, n, n_in, n_out, bw, rate)
    res["offline"] = dict(workload=f"{n} req x {n_in} in -> {n_out} out (greedy, ignore_eos)", hwkv=r,
                          roofline_tok_per_s=roof["tok_per_s"], roofline=roof,
                          roofline_fraction=r["tok_per_s"] / roof["tok_per_s"], stats=engine.stats())
    print(f"[defaults] offline {r['tok_per_s']:.0f} tok/s = {res['offline']['roofline_fraction']:.1%} of the "
          f"roofline {roof['tok_per_s']:.0f} (non-default args: {extra or 'none'}); {r['steps']} steps in "
          f"{r['seconds']:.3f} s, host waited {r['token_wait_s']:.3f} s for tokens", flush=True)
    if args.profile:
        if not host:
            res["profile"] = profile_pass(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=7)])
        res["decode_profile"] = decode_profile(engine, vocab, [n, 1], n_in)
    if args.b1_tokens:
        b = batch1(engine, cfg, vocab, args.b1_tokens, None if host else bw)
        res["batch1"] = b
        print(f"[defaults] batch-1 decode {b['tok_per_s']:.0f} tok/s, MBU {b.get('mbu', float('nan')):.1%} "
              f"(non-default args: {extra or 'none'})", flush=True)
    free_engine(engine, dev)
    write_result(result_path(args, "defaults"), json.loads(json.dumps(res, default=str)))
    return 0


def profile_pass(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """One offline pass under torch.profiler: the top CUDA kernels by total time, and wall vs GPU-busy."""
    from torch.profiler import ProfilerActivity, profile

    from hwkv.bench.e2e import run_engine
    from hwkv.bench.timeline import pass_gaps

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = run_engine(engine, work)
    rows = []
    for ev in prof.key_averages():
        cuda_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if cuda_us:
            rows.append((cuda_us, ev.key, ev.count))
    rows.sort(reverse=True)
    kernels = [dict(name=k[:120], cuda_ms=us / 1e3, count=c) for us, k, c in rows[:25]]
    busy = sum(us for us, k, _ in rows if not k.startswith(("cudaGraphLaunch", "ProfilerStep"))) / 1e6
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    print(table, flush=True)
    gaps = pass_gaps(prof)
    print(f"[defaults] GPU over the profiled pass: span {gaps.get('span_ms')} ms, busy {gaps.get('busy_ms')}, idle "
          f"{gaps.get('idle_ms')}; gaps {gaps.get('gaps_by_size')}; largest {gaps.get('largest', [])[:4]}", flush=True)
    return dict(wall_s=r["seconds"], tok_per_s=r["tok_per_s"], top_cuda=kernels, cuda_total_s_approx=busy,
                cpu_table=table, gpu_gaps=gaps)


def decode_profile(engine: Any, vocab: int, batches: list[int], prompt_len: int, steps: int = 32) -> dict[str, Any]:
    """Per batch size: host phases and wall ms per decode step against one graph replay's GPU ms
    (:func:`hwkv.bench.e2e_report.profile`), and the replay's critical path per kernel label."""
    from hwkv.bench.e2e_report import profile
    from hwkv.bench.timeline import graph_timeline

    out: dict[str, Any] = {}
    for b in batches:
        if b > engine.config.scheduler.max_num_seqs:
            continue
        step = profile(engine, vocab, b, steps=steps, prompt_len=prompt_len)
        tl = graph_timeline(engine, b, prompt_len + steps)
        out[f"batch {b}"] = dict(step=step, timeline=tl)
        top = ", ".join(f"{k} {v}" for k, v in list(tl.get("critical_us", {}).items())[:8])
        print(f"[defaults] decode batch {b} @ {prompt_len}+{steps}: wall {step.get('step_wall')} ms/step, "
              f"GPU replay {step.get('gpu_replay')} ms; replay span {tl.get('span_us')} us, idle "
              f"{tl.get('idle_us')} us; critical path (us): {top}", flush=True)
        print(f"[defaults]   first kernels (us): {tl.get('first_kernels')}", flush=True)
    return out


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(prog="hwkv bench defaults")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))

"""`hwkv bench admission`: first-chunk vs whole-prompt admission (``reserve_full_prompt``) under memory
pressure — throughput, preemptions, recomputed tokens and TTFT, both settings on one engine, same run.

The workload is random-token prompts (no prefix sharing) with a KV pool sized to hold only a
fraction of what the requests need at once (``--pool-fraction``), so admission decides who thrashes.
Each repeat runs both settings on the same engine and model, alternating the order (A B, then B A)
to cancel drift; the prefix cache is reset before every run so no run feeds the next one. Requests
arrive at once (offline, ``--request-rate 0``) or as a Poisson stream.

CPU: ``python -m hwkv bench admission`` (tiny model). GPU: ``--backend cuda --model llama-1b
--dtype bfloat16`` with the larger workload given in docs/engine.md ("Admission measurements").
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench import results_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="a local HF dir, 'tiny', or a shape of hwkv bench e2e (llama-1b)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=96)
    p.add_argument("--pool-fraction", type=float, default=0.3,
                   help="KV pool = this fraction of the blocks all requests need together")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="explicit pool size (overrides --pool-fraction)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-partial-prefills", type=int, default=1)
    p.add_argument("--request-rate", type=float, default=0.0, help="requests/s (Poisson); 0: all at once")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="{}", help="JSON dict of further Engine kwargs")
    p.add_argument("--out", default=None, help="JSON path (default <results_dir>/admission-<backend>-<date>.json)")


def _workload(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int, float]]:
    """(prompt, max_tokens, arrival offset in s) per request."""
    rng = random.Random(args.seed)
    t, work = 0.0, []
    for _ in range(args.num_requests):
        n = rng.randint(args.min_prompt, args.max_prompt)
        work.append(([rng.randrange(10, vocab - 10) for _ in range(n)], rng.randint(args.min_output, args.max_output),
                      t))
        if args.request_rate > 0:
            t += rng.expovariate(args.request_rate)
    return work


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_once(engine: Any, work: list[tuple[list[int], int, float]], reserve: bool, tag: str) -> dict[str, Any]:
    from hwkv.sampling_params import SamplingParams

    engine.scheduler.config.reserve_full_prompt = reserve  # same engine, graphs and memory for both settings
    assert engine.kv_cache_manager.reset_prefix_cache(), "prefix cache reset refused: requests still hold blocks"
    st0 = engine.stats()
    pending = sorted(range(len(work)), key=lambda i: work[i][2], reverse=True)
    done: dict[str, Any] = {}
    added: dict[str, int] = {}  # request id -> step it arrived in; first-token step counts are
    first: dict[str, int] = {}  # deterministic, unlike wall-clock times on a shared machine
    steps = 0
    t0 = time.monotonic()
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        while pending and work[pending[-1]][2] <= now:
            i = pending.pop()
            engine.add_request(f"{tag}-{i}", work[i][0], SamplingParams(temperature=0.0, max_tokens=work[i][1],
                                                                      ignore_eos=True))
            added[f"{tag}-{i}"] = steps
        if not engine.has_unfinished():
            time.sleep(max(0.0, work[pending[-1]][2] - now))
            continue
        steps += 1
        for out in engine.step():
            if out.token_ids:
                first.setdefault(out.request_id, steps)
            if out.finished:
                done[out.request_id] = out
    secs = time.monotonic() - t0
    st1 = engine.stats()
    outs = list(done.values())
    ttft = [o.metrics.ttft for o in outs]
    ttft_steps = [first[rid] - added[rid] for rid in done]
    n_out = sum(len(o.token_ids) for o in outs)
    n_prompt = sum(len(p) for p, _, _ in work)
    return {
        "reserve_full_prompt": reserve, "seconds": secs, "steps": steps, "requests": len(outs),
        "output_tok_per_s": n_out / secs, "total_tok_per_s": (n_out + n_prompt) / secs,
        "preemptions": st1["num_preemptions"] - st0["num_preemptions"],
        "recomputed_prompt_tokens": st1["prompt_tokens"] - st0["prompt_tokens"] - n_prompt,
        "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "latency_mean_s": statistics.mean(o.metrics.finish_time - o.metrics.arrival_time for o in outs),
        "ttft_p50_steps": _pct(ttft_steps, 0.5), "ttft_p99_steps": _pct(ttft_steps, 0.99),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from hwkv.bench.common import backend as get_backend
    from hwkv.bench.common import machine, model_dir, write_result

    if args.backend == "cpu":
        torch.set_num_threads(1)  # tiny model: intra-op threads only add contention
    mdir = model_dir(args)
    backend = get_backend(args.backend)
    bs = args.block_size or backend.capabilities.default_block_size
    vocab = json.loads((mdir / "config.json").read_text())["vocab_size"]
    work = _workload(args, vocab)
    need = sum(-(-(len(p) + m) // bs) for p, m, _ in work)
    longest = max(-(-(len(p) + m) // bs) for p, m, _ in work)
    blocks = args.num_kv_blocks or max(longest + 1, int(args.pool_fraction * need))
    # max_model_len: the longest request, not the model's (a 128k context would size per-request tables)
    opts = dict(num_kv_blocks=blocks, block_size=bs, dtype=args.dtype, max_model_len=longest * bs,
                max_num_partial_prefills=args.max_num_partial_prefills)
    opts.update(json.loads(args.engine_args))
    if args.max_num_batched_tokens:
        opts["max_num_batched_tokens"] = args.max_num_batched_tokens
    engine = hwkv.Engine(str(mdir), backend=backend, **opts)
    warm = [(p[:32], 4, 0.0) for p, _, _ in work[:4]]
    run_once(engine, warm, False, "warm")
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for reserve in ((False, True) if r % 2 == 0 else (True, False)):
            runs.append(run_once(engine, work, reserve, f"r{r}{int(reserve)}"))
            print(f"repeat {r} reserve_full_prompt={reserve}: {runs[-1]['seconds']:.2f}s, "
                  f"{runs[-1]['preemptions']} preemptions", flush=True)
    keys = ["seconds", "steps", "ttft_p50_steps", "ttft_p99_steps",
            "output_tok_per_s", "total_tok_per_s", "preemptions", "recomputed_prompt_tokens",
            "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "latency_mean_s"]
    summary = {str(reserve): {k: statistics.median(x[k] for x in runs if x["reserve_full_prompt"] is reserve)
                              for k in keys} for reserve in (False, True)}
    print(f"\nhwkv admission under memory pressure ({args.backend}, {args.model}, {len(work)} requests, "
          f"pool {blocks} blocks x {bs} = {blocks / need:.0%} of the workload's blocks; median of {args.repeats})")
    cols = [("out tok/s", "output_tok_per_s", ".1f"), ("tot tok/s", "total_tok_per_s", ".1f"),
            ("preempt", "preemptions", ".0f"), ("recomputed", "recomputed_prompt_tokens", ".0f"),
            ("TTFT p50 s", "ttft_p50_s", ".3f"), ("TTFT p99 s", "ttft_p99_s", ".3f"), ("steps", "steps", ".0f"),
            ("TTFT p50 st", "ttft_p50_steps", ".0f"), ("TTFT p99 st", "ttft_p99_steps", ".0f")]
    print(f"{'reserve_full_prompt':<20}" + "".join(f"{c:>12}" for c, _, _ in cols))
    for reserve, s in summary.items():
        print(f"{reserve:<20}" + "".join(f"{s[k]:>12{f}}" for _, k, f in cols))
    day = dt.date.today().isoformat()
    out = Path(args.out or results_dir() / f"admission-{args.backend}-{day}.json")
    doc = {"bench": "admission", "date": day, "device": backend.device.name, "machine": machine(),
           "args": {k: v for k, v in vars(args).items() if k != "out"}, "num_kv_blocks": blocks, "block_size": bs,
           "workload_blocks": need, "summary": summary, "runs": runs}
    write_result(out, doc)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m hwkv.bench.admission", description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))

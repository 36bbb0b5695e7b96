"""Offline A/B in ONE engine at the public defaults (``hwkv.Engine(model, backend="cuda", dtype=...)``, no other
argument): each variant sets its environment (``HWKV_CUDA_GEMM=1``, tile overrides), captures the decode graphs of
the many-token buckets again (batch > the decode ops' size, up to ``--num-requests``; nothing else is touched: the
mixed and prefill steps are eager and read the settings per call) and runs ``hwkv bench defaults``'s offline
workload (256 x 512 in / 256 out, greedy, ignore_eos). Variants alternate in rounds (``--rounds``), so drift shows;
each row has tok/s, the fraction of the roofline measured in the same run, the host's wait for tokens, and how
many requests' greedy tokens equal the first variant's. The prefix cache is reset before every run. A variant's
``"sched"`` sets scheduler options for its runs (``{"max_num_batched_tokens": 32768}``: the scheduler reads its budget
per step; the engine itself was built at the public defaults). ``--steps`` times every step on the device (an event
before and after each step's launches) and reports prefill/mixed steps apart from pure decodes.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/offline_ab.py --out DIR \\
        --variants '[{"name": "base"}, {"name": "gemm", "env": {"HWKV_CUDA_GEMM": "1"}}]'
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import hwkv
from hwkv.bench.common import copy_bandwidth, decode_read_bytes, model_dir, workload
from hwkv.bench.e2e import kv_bytes_per_token
from hwkv.bench.roofline import linear_params, matmul_rate, offline_roofline


@torch.inference_mode()
def recapture(engine: Any, lo: int, hi: int) -> int:
    """Capture the decode graphs of ``lo < batch <= hi`` again, in both sets of small decode graphs where the runner
    holds two (they take turns on steady steps, and their graphs take the greedy argmax - a recapture of the first
    set alone would measure the path before them): :func:`hwkv.engine.tp.runner.recapture`. The old graphs go first,
    which did not stop the graph pool's growth: session 9's batches ran out of memory after 8-10 variant runs (graph
    pools at 11.2 GiB beside the 90 % KV pool) - keep an A/B under ~8 recaptures."""
    from hwkv.engine.tp.runner import recapture as recapture_runner

    return recapture_runner(engine.runner, lo, hi)


class StepTimer:
    """Device time of every step: events recorded on the current stream before and after ``execute_async``'s
    launches (the step's forward and sampling), with the step's shape (prefill tokens, decode rows). A step's time is
    its own events' span; the GPU runs ahead of the host under async scheduling, so a span also holds any wait of the
    GPU for the host inside that step's launches."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.rows = engine, []
        self.orig = engine.runner.execute_async

    def __enter__(self) -> StepTimer:
        dev = self.engine.backend.device

        def timed(so: Any) -> Any:
            a, b = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
            a.record()
            out = self.orig(so)
            b.record()
            n = list(so.num_scheduled_tokens.values())
            self.rows.append((a, b, sum(x for x in n if x > 1), sum(1 for x in n if x == 1)))
            return out

        self.engine.runner.execute_async = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.runner.execute_async = self.orig

    def summary(self) -> dict[str, Any]:
        self.engine.backend.device.synchronize()
        ms = [(a.elapsed_time(b), p, d) for a, b, p, d in self.rows]
        first = [(t, p, d) for t, p, d in ms if p]  # steps with prompt tokens (prefill or mixed)
        dec = [(t, p, d) for t, p, d in ms if not p and d]
        full = [t for t, _, d in dec if d == max((x[2] for x in dec), default=0)]
        gaps = [self.rows[i][0].elapsed_time(self.rows[i + 1][0]) - ms[i][0] for i in range(len(ms) - 1)]
        return dict(steps=len(ms), span_ms=round(sum(ms_[0] for ms_ in ms) + sum(gaps), 2),
                    prompt_steps=dict(n=len(first), ms=round(sum(t for t, _, _ in first), 2),
                                      each=[dict(ms=round(t, 2), prompt_tokens=p, decodes=d) for t, p, d in first]),
                    decode_steps=dict(n=len(dec), ms=round(sum(t for t, _, _ in dec), 2),
                                      full_batch=dict(n=len(full), mean_ms=round(sum(full) / max(1, len(full)), 4)),
                                      rows=sum(d for _, _, d in dec)),
                    between_steps_ms=round(sum(gaps), 2))


def run(engine: Any, work: list[tuple[list[int], int]], steps: bool = False) -> tuple[dict[str, Any], list[list[int]]]:
    from hwkv.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    # every run prefills its prompts whole: the runs before it left them in the prefix cache (batch 2 of session 7
    # compared a cold base run with warm-cache runs: 264 against 256 steps)
    assert engine.kv_cache_manager.reset_prefix_cache(), "prefix cache reset refused: requests still hold blocks"
    wait0, steps0 = getattr(engine.runner, "token_wait_s", 0.0), engine.stats()["num_steps"]
    engine.backend.device.synchronize()
    timer = StepTimer(engine) if steps else None
    t0 = time.perf_counter()
    if timer is not None:
        with timer:
            outs = engine.generate([p for p, _ in work], params, use_tqdm=False)
    else:
        outs = engine.generate([p for p, _ in work], params, use_tqdm=False)
    engine.backend.device.synchronize()
    dt = time.perf_counter() - t0
    toks = [list(o.token_ids) for o in outs]
    r = dict(seconds=dt, tok_per_s=sum(map(len, toks)) / dt,
             token_wait_s=getattr(engine.runner, "token_wait_s", 0.0) - wait0,
             steps=engine.stats()["num_steps"] - steps0)
    if timer is not None:
        r["step_times"] = timer.summary()
    return r, toks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--backend", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default="/dev/shm/hwkv-def")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default='[{"name": "base"}, {"name": "gemm", "env": {"HWKV_CUDA_GEMM": "1"}}]')
    ap.add_argument("--gaps", action="store_true",
                    help="one more run of the first variant in round 0 under torch.profiler: the GPU's idle between "
                         "kernels over the pass (hwkv.bench.timeline.pass_gaps), not in the timed rows")
    ap.add_argument("--steps", action="store_true",
                    help="time every step on the device (StepTimer) in every run: prefill/mixed steps against pure "
                         "decodes")
    ap.add_argument("--timeline", default="",
                    help="after the rounds: ','-separated BATCH:MAX_SEQ_LEN decode graphs whose replay is taken apart "
                         "(hwkv.bench.timeline.graph_timeline, inputs pinned to that many requests of that many keys)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = json.loads(args.variants)
    mdir = model_dir(argparse.Namespace(model=args.model, dtype=args.dtype, workdir=args.workdir))
    cfg = json.loads((Path(mdir) / "config.json").read_text())
    t0 = time.perf_counter()
    engine = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype)
    print(f"[offline_ab] engine {time.perf_counter() - t0:.1f} s", flush=True)
    dev = engine.backend.device
    host = dev.torch_device.type == "cpu"
    bw = copy_bandwidth(dev, 1 << 24 if host else 1 << 30)
    rate = matmul_rate(dev, getattr(torch, args.dtype), n=256 if host else 8192)
    n, n_in, n_out, vocab = args.num_requests, args.input_len, args.output_len, cfg["vocab_size"]
    body, head = linear_params(engine.model)
    kv = kv_bytes_per_token(cfg, torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    roof = offline_roofline(cfg, body, head, decode_read_bytes(engine.model), kv, n, n_in, n_out, bw, rate)
    lo = engine.model.decode_ops.use_up_to if engine.model.decode_ops is not None else 0
    base_env = {k: os.environ.get(k) for v in variants for k in v.get("env", {})}
    base_sched = {k: getattr(engine.scheduler.config, k) for v in variants for k in v.get("sched", {})}
    work = [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=5)]
    timelines: list[dict[str, Any]] = []
    if args.timeline and not host:  # the graphs the engine captured at its start (its environment), before any run
        from hwkv.bench.e2e_report import replay_ms
        from hwkv.bench.timeline import graph_timeline

        for spec in args.timeline.split(","):
            b, s_len = map(int, spec.split(":"))
            tl = dict(graph_timeline(engine, b, s_len), replay_ms=replay_ms(engine, b, s_len))
            timelines.append(tl)
            print(f"[offline_ab] timeline {b} x {s_len}: replay {tl['replay_ms']} ms, span {tl.get('span_us')} us, "
                  f"pinned {tl.get('pinned')}, critical {tl.get('critical_us')}", flush=True)
    first: list[list[int]] | None = None
    rows = []
    gaps: dict[str, Any] = {}
    for rnd in range(args.rounds):
        for v in variants:
            for k, old in base_env.items():
                if old is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = old
            os.environ.update(v.get("env", {}))
            for k, val in {**base_sched, **v.get("sched", {})}.items():
                setattr(engine.scheduler.config, k, val)
            c0 = time.perf_counter()
            ng = recapture(engine, lo, n)
            cap = time.perf_counter() - c0
            if rnd == 0:  # compiles the variant's kernels on the eager (mixed) steps too, other tokens
                run(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, vocab, seed=6)])
            r, toks = run(engine, work, steps=args.steps)
            if args.gaps and not gaps and not host:
                from torch.profiler import ProfilerActivity, profile

                from hwkv.bench.timeline import pass_gaps

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    run(engine, work)
                gaps = dict(variant=v["name"], **pass_gaps(prof))
                print(f"[offline_ab] GPU over a profiled pass of {v['name']}: {gaps}", flush=True)
            first = toks if first is None else first
            same = sum(a == b for a, b in zip(toks, first))
            row = dict(variant=v["name"], round=rnd, env=v.get("env", {}), sched=v.get("sched", {}), **r,
                       roofline_fraction=r["tok_per_s"] / roof["tok_per_s"], graphs_recaptured=ng,
                       recapture_s=cap, requests_tokens_equal_first=same)
            rows.append(row)
            print(f"[offline_ab] round {rnd} {v['name']}: {r['tok_per_s']:.0f} tok/s = "
                  f"{row['roofline_fraction']:.1%} of {roof['tok_per_s']:.0f}; {r['steps']} steps in "
                  f"{r['seconds']:.3f} s, "
                  f"host waited {r['token_wait_s']:.3f} s; tokens equal to the first variant's in {same}/{n} "
                  f"requests ({ng} graphs recaptured in {cap:.1f} s)", flush=True)
            if "step_times" in r:
                st = r["step_times"]
                print(f"[offline_ab]   steps on the device: {st['prompt_steps']['n']} prompt steps "
                      f"{st['prompt_steps']['ms']} ms, {st['decode_steps']['n']} decode steps "
                      f"{st['decode_steps']['ms']} ms (full batch {st['decode_steps']['full_batch']}), between "
                      f"{st['between_steps_ms']} ms; prompt steps {st['prompt_steps']['each']}", flush=True)
            # written after every row: a run cut by its time limit keeps what it measured
            res = dict(bench="offline_ab", model=args.model, dtype=args.dtype,
                       device="cpu" if host else torch.cuda.get_device_name(),
                       date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       commit=os.environ.get("HWKV_COMMIT", ""),
                       command="python3 backends/cuda/scripts/offline_ab.py " + " ".join(
                           f"--{k.replace('_', '-')} {json.dumps(a) if k == 'variants' else a}"
                           for k, a in vars(args).items()),
                       workload=f"{n} req x {n_in} in -> {n_out} out (greedy, ignore_eos)", roofline=roof,
                       copy_bw_TBps=bw / 1e12, matmul_TFLOPs=rate / 1e12, rows=rows, gpu_gaps=gaps,
                       timelines=timelines)
            (out / f"offline-ab-{args.model}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()

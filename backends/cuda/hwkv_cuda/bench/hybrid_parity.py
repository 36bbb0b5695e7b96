"""bf16 greedy agreement of hybrid-attention models on the CUDA backend with HF transformers.

    python -m hwkv_cuda.bench.hybrid_parity --shape gemma3-1b,gpt-oss-small --out hybrid.json
    python -m hwkv_cuda.bench.hybrid_parity --shape gemma2-small,qwen2-window --spec-shapes gemma2-small

For each shape: a random-weight HF model is built on the GPU, saved in bfloat16, and served by
``hwkv.Engine(backend="cuda", dtype="bfloat16")`` (Triton kernels: sliding window, soft-cap, sinks);
its greedy tokens on prompts longer than the window are scored by HF's float32 forward of the same
bf16 weights (teacher forcing) under the conformance margin rule: every token's float32 logit within
``0.02 x max(1, |max logit|)`` of the argmax. HF's own bf16 greedy tokens are compared as well (for
information: two bf16 implementations may differ where logits nearly tie) and scored by the same rule
(``hf_bf16_margin_rule``: what transformers' own bf16 gives on the same shape, the yardstick for a
random model with many near-ties).

The engine runs with its defaults, so a windowed model runs with KV-cache groups (docs/hybrid-models.md):
each run records the groups (window, layers, blocks). ``--memory-len N`` first serves one request of
``N - 64`` prompt tokens + 64 decoded through a ``max_model_len=N`` engine on the first shape's
checkpoint and records the most blocks each group held (stepping the engine), against the blocks one
group of every layer would hold. ``--spec-shapes`` serves those shapes a second time speculating with
the target as its own draft model (KV-cache groups; the draft's cache on the full group's block ids)
and scores those tokens the same way.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from pathlib import Path
from typing import Any

HALF_LOGIT_MARGIN = 0.02  # conformance/test_engine.py

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma-3-1B: 26 layers (5 sliding-512 : 1 global), hidden 1152, 4 q / 1 kv heads of 256, ffn 6912,
    # vocab 262144, q/k norms, local RoPE 10k / global 1M
    "gemma3-1b": ("Gemma3Text", dict(
        hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
        max_position_embeddings=32768, rms_norm_eps=1e-6, initializer_range=0.02,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    # GPT-OSS-shaped, small: sinks, alternating window-128 / global layers, 8 experts top-2
    "gpt-oss-small": ("GptOss", dict(
        hidden_size=512, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, vocab_size=8192, sliding_window=128, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=4096, initializer_range=0.02)),
    # Gemma-2-shaped, small: attention soft-cap 5 (bites on random weights), final soft-cap 30, window 128
    "gemma2-small": ("Gemma2", dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, vocab_size=8192, sliding_window=128, query_pre_attn_scalar=64, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, max_position_embeddings=4096, initializer_range=0.05)),
    # Qwen2-shaped, small: window-128 layers from max_window_layers on (a full and a window group); its
    # family keeps the backend's fused decode ops, which run per group
    "qwen2-window": ("Qwen2", dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=8192, use_sliding_window=True, sliding_window=128, max_window_layers=2,
        max_position_embeddings=4096, initializer_range=0.05)),
    # Mistral-shaped, small: every layer windowed (one window group), fused decode ops
    "mistral-window": ("Mistral", dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=8192, sliding_window=128, max_position_embeddings=4096, initializer_range=0.05)),
    # a smoke test of this script on the CPU (--backend cpu)
    "gemma3-tiny": ("Gemma3Text", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=300, sliding_window=16, query_pre_attn_scalar=16, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], initializer_range=0.1)),
}


def build(shape: str, path: Path, dev: str, seed: int = 0) -> Any:
    """Random HF model on the GPU, saved in bfloat16; returned loaded back in float32 (the bf16 values)."""
    import torch
    import transformers

    name, kw = SHAPES[shape]
    cfg = getattr(transformers, f"{name}Config")(**kw)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.1)  # Gemma scales by (1 + w); the others by w, shifted below
                if not name.startswith("Gemma"):
                    p.add_(1.0)
            elif n.endswith("sinks") or "router" in n:
                p.normal_(0, 0.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.02)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    return load_hf(shape, path, dev, torch.float32)


def load_hf(shape: str, path: Path, dev: str, dtype: Any) -> Any:
    """The saved checkpoint as transformers loads it. (Not the built model cast back: ``.to(bfloat16)``
    also rounds the RoPE ``inv_freq`` buffer, which at positions ~700 with Qwen2's base 1e6 moved the
    reference's logits by > 10%: the engine, which loads the checkpoint, was scored against that.)"""
    import transformers

    name = SHAPES[shape][0]
    cls = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    return cls.from_pretrained(path, dtype=dtype).to(dev).eval()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(3)
    return [[rng.randrange(10, vocab - 10) for _ in range(length + 37 * i)] for i in range(n)]


def score(hf: Any, ps: list[list[int]], outs: list[list[int]], dev: str) -> dict[str, Any]:
    import torch

    worst, bad = 0.0, []
    for i, (p, toks) in enumerate(zip(ps, outs)):
        with torch.inference_mode():
            logits = hf(torch.tensor([p + toks], device=dev)).logits[0, len(p) - 1: len(p) - 1 + len(toks)].float()
        best = logits.max(-1).values
        gap = best - logits[torch.arange(len(toks)), torch.tensor(toks, device=dev)]
        worst = max(worst, float((gap / best.abs().clamp_min(1.0)).max()))
        nb = (gap > HALF_LOGIT_MARGIN * best.abs().clamp_min(1.0)).nonzero()
        if nb.numel():
            bad.append((i, int(nb[0])))
    return {"worst_relative_gap": round(worst, 5), "violations": bad, "passes": not bad}


def run_shape(shape: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import hwkv
    from hwkv.sampling_params import SamplingParams

    t0 = time.perf_counter()
    path = Path(a.workdir) / shape
    dev = "cuda" if a.backend == "cuda" else "cpu"
    hf = build(shape, path, dev)
    print(f"[{shape}] built and saved in {time.perf_counter() - t0:.1f} s", flush=True)
    vocab, window = hf.config.vocab_size, hf.config.sliding_window
    ps = prompts(a.prompts, max(window + 24, a.prompt_len), vocab)
    res: dict[str, Any] = {"shape": shape, "window": window, "prompt_lens": [len(p) for p in ps],
                           "new_tokens": a.tokens, "build_s": round(time.perf_counter() - t0, 1)}
    t0 = time.perf_counter()
    longest = max(len(p) for p in ps) + a.tokens  # graphs are captured up to max_model_len: no longer
    max_len = min(1 << (longest - 1).bit_length(), hf.config.max_position_embeddings)
    e = hwkv.Engine(str(path), backend=a.backend, dtype=a.dtype, max_num_seqs=max(a.prompts, 1),
                    max_model_len=max_len, enforce_eager=a.eager)
    try:
        res["engine_start_s"] = round(time.perf_counter() - t0, 1)
        print(f"[{shape}] engine started in {res['engine_start_s']} s", flush=True)
        res["attention_features"] = list(e.model.attention_features)
        res["kv_groups"] = groups_of(e)
        res["graphs"] = e.config.runtime.graphs
        t1 = time.perf_counter()
        outs = e.generate(ps, SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True), use_tqdm=False)
        toks = [list(o.token_ids) for o in outs]
        res["generate_s"] = round(time.perf_counter() - t1, 2)
        res["graph_steps"] = e.runner.num_graph_steps
        res["decode_ops"] = type(e.model.decode_ops).__name__ if e.model.decode_ops is not None else None
        print(f"[{shape}] generated in {res['generate_s']} s", flush=True)
    finally:
        e.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res["margin_rule"] = score(hf, ps, toks, dev)
    if shape in a.spec_shapes.split(","):
        res["spec_draft_self"] = spec_run(str(path), ps, toks, hf, a, dev, max_len)
    hf16 = load_hf(shape, path, dev, torch.bfloat16)
    same = 0
    first_div, hf_toks = [], []
    with torch.inference_mode():
        for p, t in zip(ps, toks):
            g = hf16.generate(torch.tensor([p], device=dev), max_new_tokens=a.tokens, do_sample=False,
                              min_new_tokens=a.tokens)[0, len(p):].tolist()
            hf_toks.append(g)
            same += g == t
            first_div.append(next((j for j, (x, y) in enumerate(zip(g, t)) if x != y), None))
    res["hf_bf16_identical_sequences"] = f"{same}/{len(ps)}"
    res["hf_bf16_first_divergence"] = first_div
    res["hf_bf16_margin_rule"] = score(hf, ps, hf_toks, dev)
    del hf
    res["seconds"] = round(time.perf_counter() - t0, 1)
    del hf16
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


def spec_run(path: str, ps: list[list[int]], plain: list[list[int]], hf: Any, a: argparse.Namespace,
             dev: str, max_len: int) -> dict[str, Any]:
    """The same prompts through the grouped engine speculating with the target as its own draft model
    (k = 3; its cache indexed by the full group's block ids): tokens against the plain run's, the margin
    rule against HF, acceptance, graph replays of the verify and draft steps."""
    import torch

    import hwkv
    from hwkv.sampling_params import SamplingParams

    t0 = time.perf_counter()
    e = hwkv.Engine(path, backend=a.backend, dtype=a.dtype, max_num_seqs=max(a.prompts, 1), max_model_len=max_len,
                    enforce_eager=a.eager,
                    speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": path})
    try:
        res: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - t0, 1), "kv_groups": groups_of(e),
                               "graphs": e.config.runtime.graphs}
        t1 = time.perf_counter()
        outs = e.generate(ps, SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True), use_tqdm=False)
        toks = [list(o.token_ids) for o in outs]
        res["generate_s"] = round(time.perf_counter() - t1, 2)
        st = e.stats()["spec_decode"]
        res["acceptance_rate"] = round(st["acceptance_rate"], 4)
        res["draft_tokens"] = st["draft_tokens"]
        res["verify_graph_steps"] = getattr(e.runner, "num_verify_graph_steps", 0)
        res["draft_graph_steps"] = getattr(e.runner.proposer, "num_graph_steps", 0)
        kv = e.kv_cache_manager
        res["pools_whole"] = all(m.block_pool.num_free_blocks == m.block_pool.num_usable_blocks
                                 for m in getattr(kv, "managers", [kv]))
    finally:
        e.close()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res["identical_to_plain_run"] = f"{sum(x == y for x, y in zip(toks, plain))}/{len(ps)}"
    res["first_divergence_from_plain"] = [next((j for j, (x, y) in enumerate(zip(s, p)) if x != y), None)
                                          for s, p in zip(toks, plain)]
    res["margin_rule"] = score(hf, ps, toks, dev)
    print(f"[spec] {json.dumps(res)}", flush=True)
    return res


def groups_of(e: Any) -> list[dict[str, Any]]:
    return [{"window": g.window, "layers": len(g.layers), "blocks": g.num_blocks} for g in e.config.kv_groups]


def memory_run(shape: str, a: argparse.Namespace) -> dict[str, Any]:
    """One ``a.memory_len``-token request through a grouped engine: the most blocks each group held."""
    import hwkv
    from hwkv.sampling_params import SamplingParams

    t0 = time.perf_counter()
    n = a.memory_len
    e = hwkv.Engine(str(Path(a.workdir) / shape), backend=a.backend, dtype=a.dtype, max_model_len=n,
                    max_num_seqs=4, max_num_batched_tokens=2048, enforce_eager=True)
    try:
        bs, kv = e.block_size, e.kv_cache_manager
        res: dict[str, Any] = {"shape": shape, "max_model_len": n, "block_size": bs, "kv_groups": groups_of(e),
                               "engine_start_s": round(time.perf_counter() - t0, 1),
                               "max_num_batched_tokens": e.config.scheduler.max_num_batched_tokens}
        vocab = e.model_config.vocab_size
        e.add_request("long", [(7 * i) % (vocab - 20) + 10 for i in range(n - 64)],
                      SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        most, steps, t1 = [0] * len(e.config.kv_groups), 0, time.perf_counter()
        last = list(most)
        while e.has_unfinished():
            e.step()
            steps += 1
            for r in e.scheduler.running:
                live = kv.num_live_blocks(r.request_id)
                most = [max(m, x) for m, x in zip(most, live)]
                last = live  # the last step: the window (and one block); the prefill chunk's blocks are
                # freed at the request's next block boundary (the scheduler allocates only there)
        res["serve_s"] = round(time.perf_counter() - t1, 2)
        res["steps"] = steps
        res["most_live_blocks_per_group"] = most
        res["live_blocks_per_group_last_step"] = last
        layer_block = e.kv_cache.caches[0].spec.bytes_per_block // len(e.config.kv_groups[0].layers)
        grouped = sum(m * len(g.layers) * layer_block for m, g in zip(most, e.config.kv_groups))
        one = -(-n // bs) * e.model.config.num_layers * layer_block
        at_end = sum(m * len(g.layers) * layer_block for m, g in zip(last, e.config.kv_groups))
        res["kv_bytes_request_grouped_peak_mib"] = round(grouped / 2**20, 2)
        res["kv_bytes_request_grouped_last_step_mib"] = round(at_end / 2**20, 2)
        res["kv_bytes_request_one_group_mib"] = round(one / 2**20, 2)
        res["ratio"] = round(one / grouped, 2)
        res["ratio_last_step"] = round(one / at_end, 2)
        pool = sum(c.spec.num_blocks * c.spec.bytes_per_block for c in e.kv_cache.caches)
        res["pool_mib"] = round(pool / 2**20, 1)
        res["pool_tokens_grouped_full_group"] = e.kv_cache.spec.num_blocks * bs
        res["pool_tokens_one_group_same_bytes"] = pool // (e.model.config.num_layers * layer_block) * bs
        assert all(m.block_pool.num_free_blocks == m.block_pool.num_usable_blocks for m in kv.managers)
        return res
    finally:
        e.close()


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gemma3-1b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/dev/shm/hwkv-hybrid")
    p.add_argument("--out", default=None)
    p.add_argument("--memory-len", type=int, default=0, help="then one request of this many tokens (0: none)")
    p.add_argument("--spec-shapes", default="", help="comma list of shapes also run speculating (draft = target)")
    a = p.parse_args(argv)
    dev = torch.cuda.get_device_name(0) if a.backend == "cuda" else a.backend
    doc: dict[str, Any] = {"bench": "hybrid_parity", "device": dev,
                           "torch": torch.__version__, "args": vars(a), "runs": []}
    ok = True

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")

    shapes = a.shape.split(",")
    if a.memory_len:  # first: eager, cheap, and the figure the parity runs cannot take away
        t0 = time.perf_counter()
        build(shapes[0], Path(a.workdir) / shapes[0], "cuda" if a.backend == "cuda" else "cpu")
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        print(f"[{shapes[0]}] checkpoint for the memory run in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            doc["memory"] = memory_run(shapes[0], a)
        except Exception:  # recorded, and the parity runs still go
            doc["memory"] = {"error": traceback.format_exc()}
            ok = False
        print(json.dumps(doc["memory"]), flush=True)
        save()
    for shape in shapes:
        try:
            r = run_shape(shape, a)
            ok &= r["margin_rule"]["passes"] and r.get("spec_draft_self", {}).get("margin_rule", {}).get("passes", True)
        except Exception:
            r = {"shape": shape, "error": traceback.format_exc()}
            ok = False
        print(json.dumps(r), flush=True)
        doc["runs"].append(r)
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

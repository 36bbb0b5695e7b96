"""Greedy parity with HF transformers ``generate`` on tiny random-weight checkpoints.

Llama, Qwen2, Mistral (full and sliding-window) and Gemma 2 (hybrid window/global, soft-caps)
configs are built with transformers and written with ``save_pretrained``;
HF generates each prompt alone (no padding); our engine runs the whole batch under several
scheduler configurations, each of which must produce identical tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hwkv  # noqa: E402

NEW_TOKENS = 32
VOCAB = 256


def _prompts() -> list[list[int]]:
    """8 prompts of mixed lengths (3..45); several share a 20-token prefix (prefix-cache hits)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(20)]
    out = []
    for i in range(8):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 25))]
        out.append(shared + tail if i % 2 else tail)
    return out


PROMPTS = _prompts()



def _hf_model(arch: str):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**kw, sliding_window=None)
        cls = transformers.MistralForCausalLM
    elif arch == "mistral-window":  # every layer attends through a window of 8 (prompts up to 45 + 32 tokens)
        cfg = transformers.MistralConfig(**kw, sliding_window=8)
        cls = transformers.MistralForCausalLM
    elif arch == "gemma3":  # window-8 layers with their own RoPE base, then a global one; q/k norms
        cfg = transformers.Gemma3TextConfig(**{**kw, "tie_word_embeddings": True, "num_hidden_layers": 3}, head_dim=16,
                                            query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3)
        cls = transformers.Gemma3ForCausalLM
    elif arch == "gpt_oss":  # sinks, a window-8 layer and a global one, 4 experts top-2
        cfg = transformers.GptOssConfig(**kw, head_dim=16, sliding_window=8, num_local_experts=4,
                                        num_experts_per_tok=2,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = transformers.GptOssForCausalLM
    else:  # gemma2: a window-8 layer and a global one, attention and logit soft-caps
        cfg = transformers.Gemma2Config(**{**kw, "tie_word_embeddings": True}, head_dim=16, query_pre_attn_scalar=16,
                                        sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
        cls = transformers.Gemma2ForCausalLM
    seeds = {"llama": 0, "qwen2": 1, "mistral": 2, "mistral-window": 3, "gemma2": 4, "gemma3": 5, "gpt_oss": 6}
    torch.manual_seed(seeds[arch])
    model = cls(cfg).float().eval()
    if arch == "gpt_oss":  # sinks are created empty: give them values that matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0, 1.0)
    return model


def _saved_with_reference(model, path) -> tuple[str, list[list[int]]]:
    """``model`` saved at ``path``, and its greedy continuations of ``PROMPTS`` (the reference)."""
    model.save_pretrained(path)
    ref = []
    with torch.no_grad():
        for p in PROMPTS:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            ref.append(out[0, len(p):].tolist())
    return str(path), ref


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "mistral-window", "gemma2",
                                                   "gemma3", "gpt_oss"])
def hf_case(request, tmp_path_factory):
    arch = request.param
    model = _hf_model(arch)
    if arch == "qwen2":  # random qkv biases, so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    return _saved_with_reference(model, tmp_path_factory.mktemp(f"hf-{arch}"))


CASES = {
    "default": dict(num_kv_blocks=64),
    "no_prefix_cache": dict(num_kv_blocks=64, enable_prefix_caching=False),
    "chunked_budget_32": dict(num_kv_blocks=64, max_num_batched_tokens=32, long_prefill_token_threshold=24,
                              max_num_partial_prefills=2),
    "no_chunking": dict(num_kv_blocks=64, enable_chunked_prefill=False, max_num_batched_tokens=128),
    "preemption": dict(num_kv_blocks=10, block_size=8, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_parity_with_hf(hf_case, case):
    path, ref = hf_case
    kw = dict(max_model_len=80, **CASES[case])
    engine = hwkv.Engine(path, backend="cpu", dtype="float32", **kw)
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" and o.finished for o in outs)
    stats = engine.stats()
    # windowed models run with KV-cache groups (docs/hybrid-models.md); with windows only (Mistral) a
    # request stops growing at its window, so the small pool need not preempt
    windows_only = bool(engine.config.kv_groups) and all(g.window for g in engine.config.kv_groups)
    if case == "preemption" and not windows_only:
        assert stats["num_preemptions"] > 0
    if case == "default":
        assert stats["prefix_cache_hits"] > 0
    if case == "no_prefix_cache":
        assert stats["prefix_cache_hits"] == 0
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache.spec.num_blocks
    assert not engine.runner.reqs and len(engine.runner.free_slots) == engine.config.scheduler.max_num_seqs

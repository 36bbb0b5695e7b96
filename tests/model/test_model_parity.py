"""Logits parity with HF transformers on checkpoints written by transformers' own save_pretrained:
one varlen batch, chunked prefill over a cached prefix, and decode mixed with a fresh prefill."""

from __future__ import annotations

import json

import pytest
import torch

from hwkv.model import load_model

transformers = pytest.importorskip("transformers")

PROMPT_LENS = [7, 19, 1, 33, 12]
ATOL = 1e-4

CASES = {
    "llama-llama3": ("llama", {"head_dim": 32, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama-yarn": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {}),
    # sliding-window attention (prompts of up to 33 tokens over a window of 8): every layer / only layers >= 1
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    # Gemma 2: alternating window (8) / global layers, attention and final logit soft-caps, (1 + w) norms
    "gemma2": ("gemma2", {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3, "query_pre_attn_scalar": 24,
                          "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0}),
    # Gemma 3: q/k norms, local RoPE base on window layers, layer 3 global (pattern 3), linear-scaled global RoPE
    "gemma3": ("gemma3", {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 3, "query_pre_attn_scalar": 24,
                          "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                              "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                                 "factor": 8.0}}}),
    # GPT-OSS: sinks, alternating window-8 / global layers, biased attention, 4 clamped-SwiGLU experts (top-2), yarn
    "gpt_oss": ("gpt_oss", {"head_dim": 16, "sliding_window": 8, "num_hidden_layers": 2, "num_local_experts": 4,
                            "num_experts_per_tok": 2, "swiglu_limit": 1.0}),
    # head_dim decoupled from hidden_size (4 x 32 != 64), per-head q/k norms, untied and tied
    "qwen3": ("qwen3", {"head_dim": 32}),
    "qwen3-tied-bias": ("qwen3", {"head_dim": 16, "tie_word_embeddings": True, "attention_bias": True}),
    # layer 0 routed (4 experts, top-2), layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("qwen3_moe", {"head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 48, "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-unnormed": ("qwen3_moe", {"head_dim": 16, "num_experts": 6, "num_experts_per_tok": 3,
                                         "moe_intermediate_size": 32, "norm_topk_prob": False}),
}


def hf_checkpoint(path, arch: str, **overrides):
    """A random float32 HF model (biases and norms randomised too) saved with save_pretrained."""
    names = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
             "gemma2": "Gemma2", "gemma3": "Gemma3Text",
             "gpt_oss": "GptOss"}[arch]
    cfg_cls = getattr(transformers, f"{names}Config")
    model_cls = getattr(transformers, f"{names.removesuffix('Text')}ForCausalLM")
    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, initializer_range=0.1, max_position_embeddings=256,
                  rms_norm_eps=1e-5)
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.normal_(1, 0.1)
            elif arch == "gpt_oss" and (name.endswith("sinks") or "router" in name or "experts" in name):
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return model


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(tmp_path, cpu_backend, paged_runner, case):
    arch, overrides = CASES[case]
    hf = hf_checkpoint(tmp_path, arch, **overrides)
    model, cfg, _, _ = load_model(tmp_path, cpu_backend, load_tokenizer=False)
    assert cfg.architecture == hf.config.architectures[0] and model.dtype == torch.float32
    ps = prompts(cfg.vocab_size)
    ref = torch.stack([hf_last_logits(hf, p) for p in ps])

    # 1. every prompt in one varlen prefill call
    r = paged_runner(model, cpu_backend, len(ps), 64)
    got = r.step([(i, p, 0, len(p)) for i, p in enumerate(ps)])
    assert got.dtype == torch.float32 and got.shape == (len(ps), cfg.vocab_size)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

    # 2. chunked prefill: first halves, then the rest on top of the cached prefix (last prompt held back)
    r = paged_runner(model, cpu_backend, len(ps), 64)
    early = list(range(len(ps) - 1))
    r.step([(i, ps[i], 0, len(ps[i]) // 2) for i in early if len(ps[i]) // 2 > 0])
    got = r.step([(i, ps[i], len(ps[i]) // 2, len(ps[i])) for i in early])
    torch.testing.assert_close(got, ref[early], atol=ATOL, rtol=0)

    # 3. decode steps of the early prompts mixed with the held-back prompt's full prefill
    seqs = [ps[i] + [int(got[j].argmax())] for j, i in enumerate(early)]
    last = len(ps) - 1
    got = r.step([(i, seqs[i], len(seqs[i]) - 1, len(seqs[i])) for i in early] + [(last, ps[last], 0, len(ps[last]))])
    want = torch.stack([hf_last_logits(hf, s) for s in seqs] + [ref[last]])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_rope_theta_and_rope_parameters_formats_load_identically(tmp_path, cpu_backend, paged_runner):
    new = tmp_path / "new"
    hf_checkpoint(new, "llama", **CASES["llama-llama3"][1])
    old = tmp_path / "old"
    old.mkdir()
    cfg = json.loads((new / "config.json").read_text())
    assert "rope_parameters" in cfg  # transformers 5 writes the new form
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")  # oldest spelling of the key
    cfg["rope_scaling"] = rp
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "model.safetensors").symlink_to(new / "model.safetensors")
    m_new, c_new, _, _ = load_model(new, cpu_backend, load_tokenizer=False)
    m_old, c_old, _, _ = load_model(old, cpu_backend, load_tokenizer=False)
    assert (c_new.rope_theta, c_new.rope_scaling) == (c_old.rope_theta, c_old.rope_scaling) == (500000.0, {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    ps = prompts(c_new.vocab_size)
    work = [(i, p, 0, len(p)) for i, p in enumerate(ps)]
    a = paged_runner(m_new, cpu_backend, len(ps), 64).step(work)
    b = paged_runner(m_old, cpu_backend, len(ps), 64).step(work)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tmp_path, cpu_backend, paged_runner, dtype):
    hf_checkpoint(tmp_path, "qwen2")
    m32, cfg, _, _ = load_model(tmp_path, cpu_backend, dtype="float32", load_tokenizer=False)
    m16, _, _, _ = load_model(tmp_path, cpu_backend, dtype=dtype, load_tokenizer=False)
    assert m16.dtype == dtype and all(p.dtype == dtype for p in m16.parameters())
    ps = prompts(cfg.vocab_size)
    work = [(i, p, 0, len(p)) for i, p in enumerate(ps)]
    a = paged_runner(m32, cpu_backend, len(ps), 64).step(work)
    b = paged_runner(m16, cpu_backend, len(ps), 64).step(work)
    assert b.dtype == torch.float32
    tol = 0.1 if dtype == torch.bfloat16 else 0.02
    torch.testing.assert_close(b, a, atol=tol * float(a.abs().max()), rtol=0)

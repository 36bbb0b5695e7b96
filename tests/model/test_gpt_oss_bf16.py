"""GPT-OSS in bf16 against transformers on the CPU: hwkv computes transformers' op order wherever
GPT-OSS differs from Llama (its RMSNorm scales in float32 and rounds once; the SwiGLU is
``(up + 1) * (gate * sigmoid(alpha * gate))``), so the norms and the expert loop are bit-identical on
the same bf16 input, and the whole forward matches transformers' once transformers' eager attention
keeps its scores and sink softmax in float32 as hwkv's attention does (transformers rounds the scores
and probabilities to bf16 on the way, the one remaining difference; the rest is float32 summation
order in the attention, one bf16 ulp here and there)."""

from __future__ import annotations

import pytest
import torch

from hwkv.interfaces.attention import AttentionMetadata
from hwkv.model import load_model

transformers = pytest.importorskip("transformers")
MG = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

LAYERS = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random GPT-OSS saved in bf16 (router and sinks wide enough that experts and sinks matter)."""
    cfg = transformers.GptOssConfig(
        hidden_size=128, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=512, sliding_window=16, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=4096, initializer_range=0.05)
    torch.manual_seed(0)
    m = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.normal_(1, 0.1)
            elif n.endswith("sinks") or "router" in n:
                p.normal_(0, 0.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.02)
    path = tmp_path_factory.mktemp("gpt-oss-bf16")
    m.to(torch.bfloat16).save_pretrained(path)
    return path


def _eager_fp32(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager GPT-OSS attention with the scores, the sink softmax and the weighted sum in
    float32 (one rounding of the output), as a fused attention kernel computes them."""
    k = MG.repeat_kv(key, module.num_key_value_groups).float()
    v = MG.repeat_kv(value, module.num_key_value_groups).float()
    w = torch.matmul(query.float(), k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        w = w + attention_mask.float()
    sinks = module.sinks.float().reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
    c = torch.cat([w, sinks], dim=-1)
    p = torch.softmax(c - c.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    return torch.matmul(p, v).to(query.dtype).transpose(1, 2).contiguous(), p


def _hwkv_logits(model, backend, ids: list[int]) -> torch.Tensor:
    from tests.model.conftest import PagedRunner

    r = PagedRunner(model, backend, 1, len(ids) + 4, block_size=16)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [r.tables[0]], 16)
    md = backend.attention.metadata_builder().build(meta)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(len(ids)), r.kv, md, torch.arange(len(ids))).float()


def test_norms_and_experts_are_bit_identical_to_transformers(checkpoint, cpu_backend):
    hf = transformers.GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    model, *_ = load_model(checkpoint, cpu_backend, dtype=torch.bfloat16, load_tokenizer=False)
    x = (torch.randn(48, 128, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    with torch.inference_mode():
        for i in range(LAYERS):
            h, w = hf.model.layers[i], model.model.layers[i]
            assert torch.equal(h.mlp(x[None])[0][0], w.mlp(x)), f"layer {i} experts"
            assert torch.equal(h.input_layernorm(x), w.input_layernorm(x)), f"layer {i} input norm"
            assert torch.equal(h.post_attention_layernorm(x), w.post_attention_layernorm(x)), f"layer {i} post norm"
        assert torch.equal(hf.model.norm(x), model.model.norm(x))


def test_forward_is_transformers_with_float32_attention(checkpoint, cpu_backend, monkeypatch):
    """Past the window (64 tokens, window 16): hwkv's bf16 logits are transformers' bf16 logits with
    float32 attention up to summation order (identical before the 15th token, then a few ulps: mean
    0.0017 here against 0.0062 from transformers' bf16 attention and 0.0069 with Llama's norm order)."""
    ids = torch.randint(3, 509, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    hf = transformers.GptOssForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        plain = hf(torch.tensor([ids])).logits[0].float()
    monkeypatch.setattr(MG, "eager_attention_forward", _eager_fp32)
    with torch.inference_mode():
        fp32_attention = hf(torch.tensor([ids])).logits[0].float()
    model, *_ = load_model(checkpoint, cpu_backend, dtype=torch.bfloat16, load_tokenizer=False)
    got = _hwkv_logits(model, cpu_backend, ids)
    assert torch.equal(got[:14], fp32_attention[:14])  # the same sums: bit-identical
    assert (got - fp32_attention).abs().mean() < 0.5 * (got - plain).abs().mean()

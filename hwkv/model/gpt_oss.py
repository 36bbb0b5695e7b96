"""GPT-OSS: the Llama decoder with biased q/k/v/o, a learned per-head attention sink logit
(``self_attn.sinks``, added to the softmax denominator by the backend's attention), alternating
sliding-window / global layers (``layer_types``) and a top-k MoE of clamped SwiGLU experts with
biases (``gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1)``; gate and
up interleaved in ``gate_up_proj``), routed by a biased router, softmax over the top-k logits.

The experts are a torch reference (a loop over the experts a batch hits), as transformers computes
them; fused decode ops and tensor parallelism are refused for this family.

In bf16 the op order is transformers' where GPT-OSS differs from Llama: its RMSNorm scales in
float32 and rounds once (Llama's rounds the normalised input, then scales), and the SwiGLU is
``(up + 1) * (gate * sigmoid(alpha * gate))``; the expert loop is then bit-identical to
transformers' on the same input (``tests/model/test_gpt_oss_bf16.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hwkv.interfaces.attention import AttentionImpl
from hwkv.model.config import ModelConfig
from hwkv.model.fields import ConfigFields
from hwkv.model.gemma2 import layer_types
from hwkv.model.layers import RMSNorm, param
from hwkv.model.llama import Attention, LlamaForCausalLM
from hwkv.model.registry import ModelFamily, register

GPT_OSS_FUSED_REFUSAL = "attention sinks and the clamped-SwiGLU experts are not part of DecodeOps"


def gpt_oss_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' GptOssRMSNorm: normalise and scale in float32, one rounding to the model dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)


class GptOssRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return gpt_oss_rms_norm(x, self.weight, self.eps)
        h = x + residual
        return gpt_oss_rms_norm(h, self.weight, self.eps), h


class GptOssAttention(Attention):
    def __init__(self, cfg: ModelConfig, impl: AttentionImpl, device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, impl, device, dtype)
        self.sinks = param((cfg.num_heads,), device, dtype)
        impl.sinks = self.sinks  # the same storage: the loader fills it in place


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        super().__init__()
        x, h, inter = cfg.extra, cfg.hidden_size, cfg.intermediate_size
        e = x["num_local_experts"]
        self.top_k, self.limit, self.alpha = x["num_experts_per_tok"], x["swiglu_limit"], x["swiglu_alpha"]
        self.router = nn.Module()
        self.router.weight = param((e, h), device, dtype)
        self.router.bias = param((e,), device, dtype)
        self.experts = nn.Module()
        self.experts.gate_up_proj = param((e, h, 2 * inter), device, dtype)
        self.experts.gate_up_proj_bias = param((e, 2 * inter), device, dtype)
        self.experts.down_proj = param((e, inter, h), device, dtype)
        self.experts.down_proj_bias = param((e, h), device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.weight, self.router.bias)
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        weights = top.softmax(-1)
        out = torch.zeros_like(x)
        ex = self.experts
        for e in torch.unique(idx).tolist():  # a host sync per layer: the reference path
            tok, slot = torch.where(idx == e)
            gate_up = x[tok] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
            gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
            # transformers' association: (up + 1) * (gate * sigmoid(alpha * gate)); in bf16 the other
            # order rounds differently
            y = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ ex.down_proj[e] + ex.down_proj_bias[e]
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out


class GptOssForCausalLM(LlamaForCausalLM):
    attention_class = GptOssAttention
    # the reference expert loop reads the routing on the host (torch.unique) and runs data-dependent
    # shapes: the engine runs this family eagerly (a capture would fail at engine start)
    graph_capturable = False

    def __init__(self, config: ModelConfig, attention: Any, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_positions: int | None = None, tp: Any = None):
        if tp is not None:
            raise ValueError(f"tensor parallelism is not supported for {config.architecture} (allowed: tp=1)")
        super().__init__(config, attention, device, dtype, max_positions)
        h, eps, dev = config.hidden_size, config.rms_norm_eps, self.device
        for layer in self.model.layers:
            layer.input_layernorm = GptOssRMSNorm(h, eps, dev, dtype)
            layer.post_attention_layernorm = GptOssRMSNorm(h, eps, dev, dtype)
        self.model.norm = GptOssRMSNorm(h, eps, dev, dtype)

    def make_mlp(self, layer: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        return GptOssMoE(self.config, device, dtype)

    @property
    def attention_features(self) -> tuple[str, ...]:
        return self.config.attention_features + ("attention_sinks",)


def _gpt_oss_config(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    types = layer_types(f, common["num_layers"])
    e = f.integer("num_local_experts")
    extra = {"num_local_experts": e, "num_experts_per_tok": f.integer("num_experts_per_tok", 4, hi=e),
             "swiglu_limit": f.number("swiglu_limit", 7.0, gt=0), "swiglu_alpha": f.number("swiglu_alpha", 1.702, gt=0)}
    return {"layer_types": types, "extra": extra}


register(ModelFamily("gpt_oss", ("GptOssForCausalLM",), GptOssForCausalLM, _gpt_oss_config,
                     fused_decode=GPT_OSS_FUSED_REFUSAL))

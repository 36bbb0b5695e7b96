"""Gemma 2: the Llama decoder with Gemma's changes, as transformers computes them.

* RMSNorm scales by ``1 + weight`` (in float32), and every layer norms four times: before and after
  attention, before and after the MLP (the post-norms apply to the sublayer output before the
  residual add);
* the embedding is scaled by ``sqrt(hidden_size)`` (in the model dtype);
* the MLP gate is ``gelu_pytorch_tanh``; attention scores are scaled by ``query_pre_attn_scalar ** -0.5``
  and soft-capped (``attn_logit_softcapping``), the logits too (``final_logit_softcapping``);
* layers alternate sliding-window (``layer_types``; even layers by default) and global attention.

Soft-cap and windows run in the backend's attention (``Capabilities.attention_features``); the fused
decode ops and tensor parallelism are refused for this family.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hwkv.interfaces.attention import layer_metadata
from hwkv.interfaces.layout import KVCache
from hwkv.model.config import ModelConfig
from hwkv.model.fields import ConfigFields
from hwkv.model.layers import MLP, RMSNorm
from hwkv.model.llama import LlamaForCausalLM
from hwkv.model.registry import ModelFamily, register

GEMMA_FUSED_REFUSAL = "Gemma's (1 + w) norms, post-sublayer norms and GELU MLP are not part of DecodeOps"
LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA_ACTS = ("gelu_pytorch_tanh", "gelu")  # HF Gemma 2/3 compute the tanh approximation for both


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.eps)
        h = x + residual
        return gemma_rms_norm(h, self.weight, self.eps), h


class GeluMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, attention: Any, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_positions: int | None = None, tp: Any = None):
        if tp is not None:
            raise ValueError(f"tensor parallelism is not supported for {config.architecture} (allowed: tp=1)")
        super().__init__(config, attention, device, dtype, max_positions)
        device, x = torch.device(device), config.extra
        h, eps = config.hidden_size, config.rms_norm_eps
        for layer in self.model.layers:
            layer.input_layernorm = GemmaRMSNorm(h, eps, device, dtype)
            layer.post_attention_layernorm = GemmaRMSNorm(h, eps, device, dtype)
            layer.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, device, dtype)
            layer.post_feedforward_layernorm = GemmaRMSNorm(h, eps, device, dtype)
            impl = layer.self_attn.impl
            impl.scale = x["query_pre_attn_scalar"] ** -0.5
            impl.softcap = x["attn_logit_softcapping"]
        self.model.norm = GemmaRMSNorm(h, eps, device, dtype)

    def make_mlp(self, layer: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        cfg = self.config
        return GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, device, dtype)

    @property
    def attention_features(self) -> tuple[str, ...]:
        capped = ("logit_softcap",) if self.config.extra["attn_logit_softcapping"] is not None else ()
        return self.config.attention_features + capped

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                       attn_metadata: object, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
        if slot_mapping is None:
            slot_mapping = attn_metadata.slot_mapping  # type: ignore[attr-defined]
        h = F.embedding(input_ids, self.model.embed_tokens.weight)
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        for i, layer in enumerate(self.model.layers):
            if (hk := self.layer_hooks) is not None:
                hk.wait_for_layer_load(i)
            md, sm = layer_metadata(attn_metadata, slot_mapping, i)  # KV-cache groups: the layer's group's
            out = layer.self_attn(layer.input_layernorm(h), positions, self.rope_of(i), kv_cache.layer(i), md, sm)
            if hk is not None:
                hk.save_kv_layer(i, kv_cache.layer(i), attn_metadata)
            h = h + layer.post_attention_layernorm(out)
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        return h

    def rope_of(self, layer: int) -> Any:
        """The rotary embedding of decoder layer ``layer`` (Gemma 3: a local one for window layers)."""
        return self.rotary_emb

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().compute_logits(hidden, logits_indices)
        cap = self.config.extra["final_logit_softcapping"]
        return logits if cap is None else torch.tanh(logits / cap) * cap


def layer_types(f: ConfigFields, n: int) -> tuple[str, ...]:
    """``layer_types`` of an ``n``-layer config (default: even layers sliding, odd ones global)."""
    types = f.raw("layer_types", None)
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise f.fail("layer_types", types, f"a list of {n} of {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _gemma2_config(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    act = f.string("hidden_activation", None) or f.string("hidden_act", None) or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):  # HF Gemma 2 uses the tanh approximation for both
        raise f.fail("hidden_activation", act, "gelu_pytorch_tanh")
    types = layer_types(f, common["num_layers"])
    caps = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        caps[key] = f.number(key, None, gt=0) if f.raw(key, None) is not None else None
    extra = {"query_pre_attn_scalar": f.number("query_pre_attn_scalar", 256, gt=0), **caps}
    return {"layer_types": types, "extra": extra, "tie_word_embeddings": f.flag("tie_word_embeddings", True)}


register(ModelFamily("gemma2", ("Gemma2ForCausalLM",), Gemma2ForCausalLM, _gemma2_config,
                     fused_decode=GEMMA_FUSED_REFUSAL, activations=GEMMA_ACTS))

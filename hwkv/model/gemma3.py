"""Gemma 3 (text): Gemma 2's decoder plus per-head (1 + w) RMSNorms on q and k before RoPE, and a
separate RoPE base for sliding-window layers (``rope_parameters["sliding_attention"]``, or the older
``rope_local_base_freq``; global layers use the model's ``rope_theta`` / scaling). No soft-caps by
default (read if set); windows every ``sliding_window_pattern``-th layer is global (``layer_types``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hwkv.model.config import ModelConfig
from hwkv.model.fields import ConfigFields
from hwkv.model.gemma2 import (
    GEMMA_ACTS,
    GEMMA_FUSED_REFUSAL,
    LAYER_TYPES,
    Gemma2ForCausalLM,
    GemmaRMSNorm,
    _gemma2_config,
)
from hwkv.model.llama import QKNormAttention
from hwkv.model.registry import ModelFamily, register
from hwkv.model.rope import RotaryEmbedding


class Gemma3Attention(QKNormAttention):
    norm_class = GemmaRMSNorm


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    attention_class = Gemma3Attention

    def __init__(self, config: ModelConfig, attention: Any, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, max_positions: int | None = None, tp: Any = None):
        super().__init__(config, attention, device, dtype, max_positions, tp)
        local = dataclasses.replace(config, rope_theta=config.extra["rope_local_theta"], rope_scaling=None)
        self.local_rotary_emb = RotaryEmbedding(local, max_positions or config.max_model_len, device, dtype)

    def rope_of(self, layer: int) -> RotaryEmbedding:
        return self.local_rotary_emb if self.config.window_of(layer) else self.rotary_emb


def _gemma3_config(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    n = common["num_layers"]
    if f.raw("layer_types", None) is None:
        every = f.integer("sliding_window_pattern", 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    else:
        types = f.raw("layer_types")
        if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise f.fail("layer_types", types, f"a list of {n} of {', '.join(LAYER_TYPES)}")
    out = _gemma2_config(f, {**common, "num_layers": n})
    rp = f.raw("rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get("sliding_attention"), dict):
        local = f.nested("rope_parameters", rp).nested("sliding_attention", rp["sliding_attention"])
        kind = local.string("rope_type", "default")
        if kind != "default":
            raise local.fail("rope_type", kind, "default (sliding layers' RoPE is unscaled in Gemma 3)")
        theta = local.number("rope_theta", 10000.0, gt=0)
    else:
        theta = f.number("rope_local_base_freq", 10000.0, gt=0)
    out["layer_types"] = tuple(types)
    out["extra"]["rope_local_theta"] = theta
    return out


register(ModelFamily("gemma3", ("Gemma3ForCausalLM",), Gemma3ForCausalLM, _gemma3_config,
                     fused_decode=GEMMA_FUSED_REFUSAL, per_layer_rope=True, activations=GEMMA_ACTS))

"""Qwen3 (dense): the Llama decoder plus a per-head RMSNorm on q and k before RoPE.

``head_dim`` is decoupled from ``hidden_size`` (Qwen3 sets it explicitly: q/o projections are
``num_heads * head_dim`` wide, not ``hidden_size``); q/k/v/o carry a bias only with
``attention_bias``; ``tie_word_embeddings`` as the config says; the ``sliding_window`` size applies
only with ``use_sliding_window`` (as Qwen2). The backend's fused decode ops have no q/k norm, so a
Qwen3 model always runs the plain forward.
"""

from __future__ import annotations

import torch

from hwkv.interfaces.attention import AttentionImpl
from hwkv.model.config import ModelConfig, windowed_if_enabled
from hwkv.model.layers import RMSNorm
from hwkv.model.llama import Attention, LlamaForCausalLM
from hwkv.model.registry import ModelFamily, register

QK_NORM_REFUSAL = "per-head q/k RMSNorm before RoPE is not part of DecodeOps.qkv"


class Qwen3Attention(Attention):
    def __init__(self, cfg: ModelConfig, impl: AttentionImpl, device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, impl, device, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v  # over head_dim, per head and token


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention


register(ModelFamily("qwen3", ("Qwen3ForCausalLM",), Qwen3ForCausalLM, windowed_if_enabled,
                     fused_decode=QK_NORM_REFUSAL))

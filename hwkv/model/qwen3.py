"""Qwen3 (dense): the Llama decoder plus a per-head RMSNorm on q and k before RoPE.

``head_dim`` is decoupled from ``hidden_size`` (Qwen3 sets it explicitly: q/o projections are
``num_heads * head_dim`` wide, not ``hidden_size``); q/k/v/o carry a bias only with
``attention_bias``; ``tie_word_embeddings`` as the config says; the ``sliding_window`` size applies
only with ``use_sliding_window`` (as Qwen2). The backend's fused decode ops have no q/k norm, so a
Qwen3 model always runs the plain forward.
"""

from __future__ import annotations

from hwkv.model.config import windowed_if_enabled
from hwkv.model.llama import LlamaForCausalLM, QKNormAttention
from hwkv.model.registry import ModelFamily, register

QK_NORM_REFUSAL = "per-head q/k RMSNorm before RoPE is not part of DecodeOps.qkv"


Qwen3Attention = QKNormAttention


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention


register(ModelFamily("qwen3", ("Qwen3ForCausalLM",), Qwen3ForCausalLM, windowed_if_enabled,
                     fused_decode=QK_NORM_REFUSAL))

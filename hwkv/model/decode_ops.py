"""The torch reference of :class:`hwkv.interfaces.decode_ops.DecodeOps`: the model's own unfused ops
in the same order, so a backend's fused kernels have an exact specification to be tested against."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.model.llama import rms_norm, silu_mul
from hwkv.model.rope import apply_rope


class TorchDecodeOps(DecodeOps):
    def qkv(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
            bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            impl: Any, layer_kv: Any, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int) -> torch.Tensor:
        t, q_size, kv_size = h.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = F.linear(rms_norm(h, norm_weight, eps), weight, bias).split([q_size, kv_size, kv_size], dim=-1)
        q, k = apply_rope(cos, sin, positions, q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim))
        v = v.reshape(t, num_kv_heads, head_dim)
        impl.write_kv(k, v, layer_kv, slot_mapping)
        return torch.cat([q.reshape(t, q_size), k.reshape(t, kv_size), v.reshape(t, kv_size)], dim=-1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, weight, bias)

    def norm_linear(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(rms_norm(h, norm_weight, eps), weight, bias)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(silu_mul(gate_up, gate_up.shape[-1] // 2), weight, bias)

"""The torch reference of :class:`hwkv.interfaces.decode_ops.DecodeOps`: the model's own unfused ops
in the same order, so a backend's fused kernels have an exact specification to be tested against.

A backend whose fused kernels are drop-in primitives (an RMSNorm, a RoPE, a SiLU-and-mul) subclasses
:class:`TorchDecodeOps` and overrides only :meth:`~TorchDecodeOps.rms_norm`, :meth:`~TorchDecodeOps.rope`
and :meth:`~TorchDecodeOps.silu_mul`: how they compose into the four decode ops stays here, once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.model.llama import rms_norm, silu_mul
from hwkv.model.rope import apply_rope


class TorchDecodeOps(DecodeOps):
    # ---- primitives: what a backend with drop-in fused kernels overrides ------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]`` and ``k [T, H_kv, D]`` rotated at ``positions`` (as ``apply_rope``), same shapes."""
        return apply_rope(cos, sin, positions, q, k)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``gate_up = [gate | up]``."""
        return silu_mul(gate_up, gate_up.shape[-1] // 2)

    # ---- the decode ops ---------------------------------------------------------------------------
    def qkv(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
            bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            impl: Any, layer_kv: Any, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int) -> torch.Tensor:
        t, q_size, kv_size = h.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        if weight.shape[0] != q_size + 2 * kv_size:
            raise ValueError(f"qkv weight has {weight.shape[0]} rows, expected (H + 2 H_kv) * D = "
                             f"{q_size + 2 * kv_size}")
        q, k, v = F.linear(self.rms_norm(h, norm_weight, eps), weight, bias).split([q_size, kv_size, kv_size], -1)
        q, k = self.rope(cos, sin, positions, q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim))
        v = v.reshape(t, num_kv_heads, head_dim)
        impl.write_kv(k, v, layer_kv, slot_mapping)
        return torch.cat([q.reshape(t, q_size), k.reshape(t, kv_size), v.reshape(t, kv_size)], dim=-1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, weight, bias)

    def norm_linear(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(self.rms_norm(h, norm_weight, eps), weight, bias)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(self.silu_mul(gate_up), weight, bias)

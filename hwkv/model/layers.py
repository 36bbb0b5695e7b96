"""Building blocks shared by the model families: linear, RMSNorm and the SiLU-gated MLP.

Parameters are allocated uninitialised on the target device (the loader fills them). The math is
in free functions so the engine may ``torch.compile`` them (:mod:`hwkv.model.fuse`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def param(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T + b``."""

    def __init__(self, n_in: int, n_out: int, bias: bool, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.weight = param((n_out, n_in), device, dtype)
        self.bias = param((n_out,), device, dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (also per head: q/k norms of ``[T, H, D]``)."""

    def __init__(self, dim: int, eps: float, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.weight = param((dim,), device, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """``norm(x)``, or with ``residual``: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # the residual add folded into the next norm: one fused kernel per pair once compiled
    h = x + residual
    return rms_norm(h, weight, eps), h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as HF: normalise in float32, cast back, then scale.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split([inter, inter], dim=-1)
    return F.silu(gate) * up


class MLP(nn.Module):
    """SiLU-gated MLP; gate and up are one fused matmul (HF's two tensors fill its row halves)."""

    def __init__(self, hidden: int, inter: int, bias: bool, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = Linear(hidden, 2 * inter, bias, device, dtype)
        self.down_proj = Linear(inter, hidden, bias, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x), self.inter))

"""Rotary position embedding (neox / rotate-half style) with HF-identical frequency schedules.

cos/sin are precomputed for every position up to ``max_positions`` and gathered by ``positions``
inside the forward, so the forward never synchronises with the host.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from hwkv.model.config import ModelConfig


def _linear_ramp(lo: float, hi: float, n: int) -> torch.Tensor:
    if lo == hi:
        hi += 0.001  # as HF: avoid a zero-width ramp
    return torch.clamp((torch.arange(n, dtype=torch.float32) - lo) / (hi - lo), 0, 1)


def inv_freq_and_scale(config: ModelConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2] float32, attention_factor)`` exactly as transformers computes them."""
    dim, base = config.head_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    sc = config.rope_scaling
    if sc is None:
        return inv_freq, 1.0
    kind = sc["rope_type"]
    if kind == "linear":
        return inv_freq / sc["factor"], 1.0
    if kind == "llama3":
        factor, lo_f, hi_f = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old_len = sc["original_max_position_embeddings"]
        lo_wavelen, hi_wavelen = old_len / lo_f, old_len / hi_f
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > lo_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo_f) / (hi_f - lo_f)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < hi_wavelen) * ~(wavelen > lo_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if kind == "yarn":
        orig = sc["original_max_position_embeddings"]
        factor = sc.get("factor") or config.max_position_embeddings / orig

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attn_factor = sc.get("attention_factor")
        if attn_factor is None:
            m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
            attn_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if sc.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
        extra = 1 - _linear_ramp(lo, hi, dim // 2).to(device)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        return inv, float(attn_factor)
    raise ValueError(f"rope type {kind!r} is not supported")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """cos/sin cache ``[max_positions, head_dim]`` in the model dtype (HF casts to it too)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device | str, dtype: torch.dtype):
        super().__init__()
        inv_freq, scale = inv_freq_and_scale(config, device)
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_positions = max_positions
        self.register_buffer("cos", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scale).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, H, D]``, ``k [T, H_kv, D]`` rotated by the angles of ``positions [T]``."""
        return apply_rope(self.cos, self.sin, positions, q, k)


def apply_rope(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotation by the cached angles of ``positions`` (a free function: the engine may
    ``torch.compile`` it into one kernel)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s

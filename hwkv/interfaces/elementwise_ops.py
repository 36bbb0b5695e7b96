"""ElementwiseOps: optional hand-written RMSNorm / RoPE / SiLU·mul for forwards of many tokens (a backend's
``elementwise_ops()``).

Where the engine fuses elementwise ops (``fuse_elementwise``, on with graphs) the model's RMSNorm (with its
residual add), RoPE and SiLU·mul run as torch.compile'd functions (:mod:`hwkv.model.fuse`); a backend may offer
its own kernels for them instead, taken first, call by call.

Contract:

* Each op computes the hwkv.model function of the same name (``rms_norm``, ``add_rms_norm`` in
  hwkv/model/layers.py, ``apply_rope`` in rope.py as ``rope``, ``silu_mul``) in the inputs' dtype, rounding to
  it wherever that function's torch ops round; only ``rsqrt`` and ``exp`` may differ in their last bit.
* Results are new tensors (``rope``: contiguous ``[T, H, D]`` q and ``[T, H_kv, D]`` k, from views of the
  fused qkv output); inputs are never written.
* No op synchronises with the host, so all can be captured in a graph.
* An op returns ``None`` for an input it does not take (a dtype, layout or width): that call then runs the
  compiled function. It never returns a wrong result instead.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ElementwiseOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rms_norm(x + residual), x + residual)``."""

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Neox RoPE of ``q [T, H, D]`` and ``k [T, H_kv, D]`` by the rows ``positions`` of ``cos``/``sin``."""

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
        """``silu(gate_up[:, :inter]) * gate_up[:, inter:]``."""

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Optional (a backend may leave it out): the LM head's float32 logits ``x @ weight.T`` (``x [R, hidden]``,
        ``weight [vocab, hidden]``, both in the model dtype) written as float32 by the product itself, with no
        cast pass over ``[R, vocab]``. The one exception to the rounding rule above: the float32 accumulator is
        not rounded to the model dtype first (the model's path is ``F.linear(x, weight).float()``)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """Optional (a backend may leave it out): ``F.linear(x, weight, bias)`` of a plain projection (``x [T, K]``,
        ``weight [N, K]``) in the model dtype, for the shapes where the backend's product beats its BLAS (a
        narrow output at a few hundred tokens). The float32 accumulation may be summed in another order than the
        BLAS's, so the result may differ from it in the last bit of the model dtype; it is the same bits on every
        call with the same inputs (no order that depends on scheduling)."""

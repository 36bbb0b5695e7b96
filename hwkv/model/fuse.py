"""Fused elementwise ops: the model's RMSNorm (+ residual add), RoPE and SiLU·mul forwards through
``torch.compile``, one kernel each where eager torch launches 2–12 small ones. The engine applies
it together with graph decode, where those launches dominate a small model's step."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hwkv.model.gemma2 import GemmaRMSNorm, gemma_rms_norm
from hwkv.model.layers import MLP, Linear, RMSNorm, add_rms_norm, rms_norm, silu_mul
from hwkv.model.rope import RotaryEmbedding, apply_rope


def fuse_elementwise(model: Any, backend: str = "inductor", kernels: Any = None) -> int:
    """Replace the model's RMSNorm (with its residual add), RoPE and SiLU·mul forwards by
    ``torch.compile``d functions (one fused kernel each instead of 2–12 small ones; a decode step
    of a small model is dominated by those launches). Same math; shapes are dynamic, so one
    compilation (plus one for a single token) serves every batch. Dynamo keeps at most 8 variants
    per function per process: a process building engines of many dtypes runs the surplus variants
    uncompiled (correct, slower).

    ``kernels``: a backend's hand-written ops (``Backend.elementwise_ops()``, contract:
    :mod:`hwkv.interfaces.elementwise_ops`), taken first; an op that returns ``None`` for a call leaves it
    to the compiled function. Gemma's norms stay compiled.
    Returns the number of modules patched."""

    rms = _first(kernels, "rms_norm", torch.compile(rms_norm, dynamic=True, backend=backend))
    add_rms = _first(kernels, "add_rms_norm", torch.compile(add_rms_norm, dynamic=True, backend=backend))
    gemma_rms = torch.compile(gemma_rms_norm, dynamic=True, backend=backend)
    gemma_add_rms = torch.compile(_gemma_add_rms_norm, dynamic=True, backend=backend)
    rope = _first(kernels, "rope", torch.compile(apply_rope, dynamic=True, backend=backend))
    act = _first(kernels, "silu_mul", torch.compile(silu_mul, dynamic=True, backend=backend))
    n = 0
    if kernels is not None and getattr(kernels, "logits", None) is not None and hasattr(model, "logits_op"):
        model.logits_op = kernels.logits  # the LM head's float32 logits without a cast pass (compute_logits)
    lin = getattr(kernels, "linear", None) if kernels is not None else None
    # exact types: a subclass computes something else (Gemma's norms scale by 1 + w, its MLP is GELU)
    for m in model.modules():
        if type(m) is RMSNorm:
            m.forward = lambda x, residual=None, m=m: (rms(x, m.weight, m.eps) if residual is None
                                                        else add_rms(x, residual, m.weight, m.eps))
        elif type(m) is GemmaRMSNorm:
            m.forward = lambda x, residual=None, m=m: (gemma_rms(x, m.weight, m.eps) if residual is None
                                                        else gemma_add_rms(x, residual, m.weight, m.eps))
        elif isinstance(m, RotaryEmbedding):
            m.forward = lambda positions, q, k, m=m: rope(m.cos, m.sin, positions, q, k)
        elif type(m) is MLP:
            m.forward = lambda x, m=m: m.down_proj(act(m.gate_up_proj(x), m.inter))
        elif type(m) is Linear and lin is not None:  # the backend's product where it takes the shape
            m.forward = lambda x, m=m: _linear(lin, x, m.weight, m.bias)
        else:
            continue
        n += 1
    return n


def _linear(op: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = op(x, weight, bias)
    return F.linear(x, weight, bias) if y is None else y


def _first(kernels: Any, name: str, compiled: Any) -> Any:
    """``kernels.<name>`` where it returns a result, else ``compiled``."""
    op = getattr(kernels, name, None) if kernels is not None else None
    if op is None:
        return compiled

    def call(*args: Any) -> Any:
        out = op(*args)
        return compiled(*args) if out is None else out
    return call


def _gemma_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return gemma_rms_norm(h, weight, eps), h

"""DecodeOps: optional fused dense ops for steps of a few tokens (a backend's ``decode_ops()``).

At batch 1–8 a decoder layer's projections are GEMVs bound by their weight read plus a fixed ramp
per kernel, and the norms, RoPE, activation and KV write around them are nothing but ramp. A backend
may therefore offer these four ops, each replacing a run of small kernels with one; the model
(hwkv/model/llama.py) uses them for every forward of at most ``use_up_to`` tokens (``max_tokens``,
or less where the backend's ``preferred_tokens`` says so) when the engine was built with them
(``Engine(decode_ops=...)``).

Contract (the torch reference is :class:`hwkv.model.decode_ops.TorchDecodeOps`):

* Inputs are ``[T, ...]`` token-major with a unit last stride, ``T <= max_tokens``; weights are
  ``[N, K]`` as in ``F.linear``; biases ``[N]`` or ``None``. Results are new tensors of the
  activation dtype; inputs are never written.
* Each op computes exactly the sequence of torch ops named in its docstring, rounding to the
  activation dtype wherever those ops do; only the order of the summation inside a dot product may
  differ. The conformance suite compares with those ops run in the same dtype and bounds the error
  (elementwise, and in norm by one rounding step of the dtype): it checks the error's size, not
  the rounding order itself.
* ``qkv`` also writes the k and v rows (after RoPE on k) into ``layer_kv`` at ``slot_mapping``
  exactly like ``AttentionImpl.write_kv`` (slot ``-1`` skipped, never a write outside the cache); the
  model then calls ``AttentionImpl.forward`` without ``write_kv``.
* No op synchronises with the host, so all of them can be captured in a CUDA graph.
* ``validate(...)`` returns the reasons a model cannot use the ops (empty list: it can).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class DecodeOps(ABC):
    max_tokens: int = 8  # the most tokens the ops accept (and conformance checks)
    # the model takes the fused path for forwards of at most this many tokens: where the backend
    # measured them faster than its plain ops (None: max_tokens)
    preferred_tokens: int | None = None

    @property
    def use_up_to(self) -> int:
        return self.max_tokens if self.preferred_tokens is None else min(self.preferred_tokens, self.max_tokens)

    def validate(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> list[str]:
        """Reasons these ops cannot serve the model (empty: they can)."""
        return []

    def rank_sum(self, comm: Any) -> Any | None:
        """Ops that run tensor parallelism's row-parallel all-reduce inside the projections around it
        (``None``: not offered; the model then calls ``comm.all_reduce_add`` after each). The object
        returned has ``linear(x, weight, bias)`` and ``silu_linear(gate_up, weight, bias)``, which return
        a pending sum (this rank's partial output, already on its way to the peers), and ``qkv(s, h,
        ...)`` and ``norm_linear(s, h, ...)`` (the arguments after ``h`` as the ops here), which form
        ``h = h + sum over ranks of s`` first and return ``(output, h)``; ``sum(s, h)`` forms it alone.
        Every rank makes the same calls in the same order; ``h`` is rounded as ``all_reduce_add``."""
        return None

    @abstractmethod
    def qkv(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
            bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            impl: Any, layer_kv: Any, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int) -> torch.Tensor:
        """``qkv = linear(rms_norm(h), weight, bias)``; q and k heads rotated by ``apply_rope(cos,
        sin, positions, ...)``; k and v written to ``layer_kv`` at ``slot_mapping`` (as ``impl.
        write_kv``). Returns ``[T, (H + 2 H_kv) D]``: rotated q | rotated k | v."""

    @abstractmethod
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x, weight, bias)`` (the linear rounded first)."""

    @abstractmethod
    def norm_linear(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        """``linear(rms_norm(h, norm_weight, eps), weight, bias)``."""

    @abstractmethod
    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        """``residual + linear(silu(gate) * up, weight, bias)`` with ``gate_up = [gate | up]``."""

    def norm_logits(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
        """The LM head: ``linear(rms_norm(h, norm_weight, eps), weight).float()`` - float32 logits of values rounded
        to the activation dtype first. A backend may write them as float32 in its projection instead of a cast pass
        after it (one kernel fewer in a decode step)."""
        return self.norm_linear(h, norm_weight, eps, weight, None).float()

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Optional, for the greedy sampler: ``logits.argmax(-1)`` of float32 ``[R, V]`` logits as int64 ``[R]`` on
        their device, without a host sync - the first index of a row's maximum, NaN counting as the maximum, exactly
        as torch. ``None``: not offered for these logits (the sampler's own argmax runs)."""
        return None

""":class:`DecodeOps` on Ascend: the fused torch_npu ops vllm-ascend runs in every forward.

* RMSNorm: ``npu_rms_norm(x, weight, eps)[0]`` (vllm-ascend ``AscendRMSNorm`` without residual).
* RoPE: ``npu_rotary_mul(x [1, T, N, D], cos [1, T, 1, D], sin [1, T, 1, D])`` in its default
  rotate-half mode (vllm-ascend ``AscendApplyRotaryEmb``), cos/sin gathered by position on device.
* SiLU-and-mul: ``npu_swiglu([gate | up])`` (vllm-ascend ``AscendSiluAndMul``).
* Projections: ``F.linear`` (a cube-unit matmul on the NPU), the residual added after it; the
  composition of these into the four decode ops is the torch reference's (``TorchDecodeOps``).

Each fused op computes in float32 and rounds once, where the torch reference rounds after each
step: within the decode-ops tolerance, never less exact. ``npu_add_rms_norm`` (residual add fused
into the next norm, as vllm-ascend's ``AscendRMSNorm`` does with a residual) does not fit this hook:
the add ends ``linear`` while the norm starts the next op, whose weight ``linear`` never sees.
"""

from __future__ import annotations

from typing import Any

import torch

from hwkv.model.decode_ops import TorchDecodeOps
from hwkv_ascend import _npu

OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what all three ops accept
ROTARY_MAX_HEAD = 896  # npu_rotary_mul half mode on A2/A3: D even and < 896


class AscendDecodeOps(TorchDecodeOps):
    """The reference's composition (hwkv.model.decode_ops) over the three torch_npu primitives."""

    def __init__(self, npu: Any):
        self.npu = npu

    @classmethod
    def create(cls) -> AscendDecodeOps | None:
        npu = _npu.torch_npu()
        return cls(npu) if all(hasattr(npu, op) for op in OPS) else None

    def validate(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> list[str]:
        reasons = []
        if dtype not in DTYPES:
            reasons.append(f"dtype {dtype} (allowed: {', '.join(map(str, DTYPES))})")
        if head_dim % 2 or head_dim >= ROTARY_MAX_HEAD:
            reasons.append(f"head_dim {head_dim}: npu_rotary_mul needs an even head dim < {ROTARY_MAX_HEAD}")
        if kv_dtype != dtype:
            reasons.append(f"KV cache dtype {kv_dtype} differs from the activations' {dtype} (the KV write "
                           "casts without a scale; allowed: the same dtype)")
        return reasons

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.npu.npu_rms_norm(x, weight, eps)[0]

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, d = q.shape[0], q.shape[-1]
        c = cos.index_select(0, positions).view(1, t, 1, d)
        s = sin.index_select(0, positions).view(1, t, 1, d)
        return (self.npu.npu_rotary_mul(q.reshape(1, *q.shape), c, s).view(q.shape),
                self.npu.npu_rotary_mul(k.reshape(1, *k.shape), c, s).view(k.shape))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_swiglu(gate_up, dim=-1)

""":class:`DecodeOps` on Ascend: the fused torch_npu ops vllm-ascend runs in every forward.

* RMSNorm: ``npu_rms_norm(x, weight, eps)[0]`` (vllm-ascend ``AscendRMSNorm`` without residual).
* RoPE: ``npu_rotary_mul(x [1, T, N, D], cos [1, T, 1, D], sin [1, T, 1, D])`` in its default
  rotate-half mode (vllm-ascend ``AscendApplyRotaryEmb``), cos/sin gathered by position on device.
* SiLU-and-mul: ``npu_swiglu([gate | up])`` (vllm-ascend ``AscendSiluAndMul``).
* Projections: ``F.linear`` (a cube-unit matmul on the NPU), the residual added after it.

Each fused op computes in float32 and rounds once, where the torch reference rounds after each
step: within the decode-ops tolerance, never less exact. ``npu_add_rms_norm`` (residual add fused
into the next norm, as vllm-ascend's ``AscendRMSNorm`` does with a residual) does not fit this hook:
the add ends ``linear`` while the norm starts the next op, whose weight ``linear`` never sees.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hwkv.interfaces.decode_ops import DecodeOps
from hwkv_ascend import _npu

OPS = ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what all three ops accept
ROTARY_MAX_HEAD = 896  # npu_rotary_mul half mode on A2/A3: D even and < 896


class AscendDecodeOps(DecodeOps):
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

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.npu.npu_rms_norm(x, weight, eps)[0]

    def qkv(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
            bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            impl: Any, layer_kv: Any, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int) -> torch.Tensor:
        t, q_size, kv_size = h.shape[0], num_heads * head_dim, num_kv_heads * head_dim
        if weight.shape[0] != q_size + 2 * kv_size:
            raise ValueError(f"qkv weight has {weight.shape[0]} rows, expected (H + 2 H_kv) * D = "
                             f"{q_size + 2 * kv_size}")
        q, k, v = F.linear(self._rms_norm(h, norm_weight, eps), weight, bias).split([q_size, kv_size, kv_size], -1)
        c = cos.index_select(0, positions).view(1, t, 1, head_dim)
        s = sin.index_select(0, positions).view(1, t, 1, head_dim)
        q = self.npu.npu_rotary_mul(q.reshape(1, t, num_heads, head_dim), c, s).view(t, num_heads, head_dim)
        k = self.npu.npu_rotary_mul(k.reshape(1, t, num_kv_heads, head_dim), c, s).view(t, num_kv_heads, head_dim)
        v = v.reshape(t, num_kv_heads, head_dim)
        impl.write_kv(k, v, layer_kv, slot_mapping)
        return torch.cat([q.reshape(t, q_size), k.reshape(t, kv_size), v.reshape(t, kv_size)], dim=-1)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, weight, bias)

    def norm_linear(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(self._rms_norm(h, norm_weight, eps), weight, bias)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(self.npu.npu_swiglu(gate_up, dim=-1), weight, bias)

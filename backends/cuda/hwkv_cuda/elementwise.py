"""Triton elementwise ops for the model's fused path (:func:`hwkv.model.fuse.fuse_elementwise`): RMSNorm (+
residual add), neox RoPE and SiLU·mul as one hand-written launch each instead of torch.compile's kernels.

Why: torch.compile's kernels (dynamic shapes) ran far below the copy bandwidth at the offline batch on
the H100 (issue 36, ``bench/results/issue36-round1-H100-2026-11-28-868af0d.md``): SiLU·mul 27 µs per
batch-256 decode call where its 12 MB need ~4 µs, RoPE 21 µs, and a prefill-sized SiLU·mul 0.53 ms for
768 MB. Each op returns ``None`` where it does not apply (a dtype, layout or width it does not take); the
model then runs the compiled function. ``logits`` gives the LM head's float32 logits straight from cuBLAS (no cast
pass), ``linear`` the narrow projections at a few hundred tokens as split-K (:mod:`hwkv_cuda.gemm`,
``HWKV_CUDA_GEMM=1``). ``HWKV_CUDA_ELEMENTWISE=0`` turns them all off (A/B runs).

Measured (one H200, main 479d2cf, ``hwkv bench defaults --model llama-1b``, no engine argument: 256 x 512 in /
256 out): offline 49,798 tok/s = 61.6% of the roofline, against 45,423 = 56.5% at 09915b9 without them (another
run, same device type); in the batch-256 decode step RMSNorm takes 2.0-2.5 µs, RoPE 1.4-2.4 µs for q and k,
SiLU·mul 3.1 µs (``bench/results/issue36-batch2-H200-2026-11-28-479d2cf.md``).
"""

from __future__ import annotations

import os

import torch

from hwkv_cuda.gemm import SplitKLinear
from hwkv_cuda.tiles import pow2

ENV = "HWKV_CUDA_ELEMENTWISE"
ROPE_QK_ENV = "HWKV_CUDA_ROPE_QK"  # "0": q and k in a launch each (A/B switch; default one launch for both)
PDL_ENV = "HWKV_CUDA_ELEMENTWISE_PDL"  # "1": these kernels and the KV write launch with PDL (A/B switch; off)
BLASLT_ENV = "HWKV_CUDA_BLASLT"  # "1": the model's linears through cuBLASLt's heuristics (A/B switch, off)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROW = 16384  # widest RMSNorm row kept in one program's registers


class TritonElementwise:
    """:class:`hwkv.interfaces.elementwise_ops.ElementwiseOps` in Triton. ``device_type``: where the tensors
    must live ("cpu" only for tests under Triton's interpreter)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self._no_fp32_mm = False  # torch.mm(..., out_dtype=float32) raised once (logits)
        self._linear = SplitKLinear(device_type)  # narrow projections at many tokens (HWKV_CUDA_GEMM=1)

    def _pdl(self, x: torch.Tensor) -> dict:
        """Launch arguments for programmatic dependent launch where ``HWKV_CUDA_ELEMENTWISE_PDL=1`` and the device
        has it (the kernel then waits for the previous kernel's writes first): ``{"PDL": True, "launch_pdl": True}``,
        else ``{}``."""
        if os.environ.get(PDL_ENV, "0") != "1" or x.device.type != "cuda":
            return {}
        from hwkv_cuda.launch import use_pdl

        return {"PDL": True, "launch_pdl": True} if use_pdl(x.device) else {}

    def _ok(self, *ts: torch.Tensor) -> bool:
        return all(t.device.type == self.device_type and t.dtype in DTYPES and t.stride(-1) == 1 for t in ts)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        return self._norm(x, None, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._norm(x, residual, weight, eps)

    def _norm(self, x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float) -> object:
        from hwkv_cuda.kernels.elementwise import rms_norm_kernel

        n = x.shape[-1]
        if (x.dim() != 2 or not self._ok(x, weight) or weight.shape != (n,) or n > MAX_ROW
                or (res is not None and (res.shape != x.shape or res.dtype != x.dtype or not self._ok(res)))):
            return None
        y = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
        h = torch.empty_like(x, memory_format=torch.contiguous_format) if res is not None else y
        if x.shape[0]:
            block = pow2(n)
            rms_norm_kernel[(x.shape[0],)](
                x, res if res is not None else x, weight, y, h, n, eps, x.stride(0),
                (res if res is not None else x).stride(0), y.stride(0), h.stride(0), HAS_RES=res is not None,
                BLOCK=block, num_warps=8 if block >= 4096 else 4, **self._pdl(x))
        return y if res is None else (y, h)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor | None:
        from hwkv_cuda.kernels.elementwise import silu_mul_kernel

        if gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter or not self._ok(gate_up):
            return None
        y = torch.empty((gate_up.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, pow2(inter))
        cols = -(-inter // block)
        if gate_up.shape[0] and cols <= 65535:
            silu_mul_kernel[(gate_up.shape[0], cols)](gate_up, y, inter, gate_up.stride(0), y.stride(0),
                                                      BLOCK=block, num_warps=4, **self._pdl(gate_up))
        elif gate_up.shape[0]:
            return None
        return y

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """cuBLAS's product with a float32 output (``torch.mm(..., out_dtype=float32)``): at the offline batch the
        model's ``F.linear(x, w).float()`` spent a second pass over the logits, 97 µs of a 2.33 ms batch-256 decode
        step of the 1B shape on the H200 (bench/results/issue36-batch2-H200-2026-11-28-479d2cf.md)."""
        if (x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.dtype != weight.dtype
                or x.dtype not in (torch.bfloat16, torch.float16) or not self._ok(x, weight)
                or self.device_type != "cuda" or self._no_fp32_mm):
            return None
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):  # a torch without it: the model's path, from now on
            self._no_fp32_mm = True  # (the first call is an eager warm-up, never inside a graph capture)
            return None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """The split-K product (:mod:`hwkv_cuda.gemm`) where its tiles fill SMs cuBLAS's leave idle; else, with
        ``HWKV_CUDA_BLASLT=1``, ``F.linear`` under cuBLASLt's heuristics (``preferred_blas_library``, restored
        after the call; a graph capture records the kernels it picked). ``None``: the model's ``F.linear``."""
        y = self._linear(x, weight, bias)
        if y is None and os.environ.get(BLASLT_ENV, "0") == "1" and x.device.type == "cuda":
            prev = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                y = torch.nn.functional.linear(x, weight, bias)
            finally:
                torch.backends.cuda.preferred_blas_library(prev)
        return y

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        d = q.shape[-1]
        if (q.dim() != 3 or k.dim() != 3 or k.shape[-1] != d or d % 2 or cos.shape[-1] != d
                or not self._ok(q, k, cos, sin) or cos.stride() != sin.stride()
                or not q.dtype == k.dtype == cos.dtype == sin.dtype or positions.dim() != 1
                or positions.shape[0] != q.shape[0] or k.shape[0] != q.shape[0]):
            return None
        if os.environ.get(ROPE_QK_ENV, "1") == "0":
            return self._rope(cos, sin, positions, q), self._rope(cos, sin, positions, k)
        return self._rope_qk(cos, sin, positions, q, k)

    def _rope_qk(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from hwkv_cuda.kernels.elementwise import rope_qk_kernel

        t, hq, d = q.shape
        hk = k.shape[1]
        qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
        ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
        block_h = min(pow2(max(hq, hk)), max(1, 2048 // d))  # as _rope's for the wider of the two
        qb, kb = -(-hq // block_h), -(-hk // block_h)
        if t:
            rope_qk_kernel[(t, qb + kb)](q, k, qo, ko, cos, sin, positions, hq, hk, qb, q.stride(0), q.stride(1),
                                         k.stride(0), k.stride(1), cos.stride(0), HALF=d // 2, HALF_PAD=pow2(d // 2),
                                         BLOCK_H=block_h, num_warps=4, **self._pdl(q))
        return qo, ko

    def _rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        from hwkv_cuda.kernels.elementwise import rope_kernel

        t, heads, d = x.shape
        out = torch.empty((t, heads, d), dtype=x.dtype, device=x.device)
        block_h = min(pow2(heads), max(1, 2048 // d))
        if t:
            rope_kernel[(t, -(-heads // block_h))](x, out, cos, sin, positions, heads, x.stride(0), x.stride(1),
                                                   cos.stride(0), HALF=d // 2, HALF_PAD=pow2(d // 2),
                                                   BLOCK_H=block_h, num_warps=4, **self._pdl(x))
        return out


def elementwise_ops() -> TritonElementwise | None:
    """The ops, or ``None`` where ``HWKV_CUDA_ELEMENTWISE=0`` (torch.compile's kernels run)."""
    return None if os.environ.get(ENV, "1") == "0" else TritonElementwise()

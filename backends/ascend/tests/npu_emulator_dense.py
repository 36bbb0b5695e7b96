"""CPU emulation of the torch_npu dense ops the Ascend ``DecodeOps`` call — for tests only.

Each op states where its rules were read:

* ``npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)``: op-plugin
  ``docs/context`` "(beta) torch_npu.npu_rms_norm" and the torchair converter
  (``torch.ops.npu.npu_rms_norm.default``): float16/bfloat16/float32, 2-8 dims, gamma of self's
  dtype matching self's trailing dims; outputs ``y`` and ``rstd`` (the reciprocal RMS, float32).
* ``npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor,
  Tensor)``: ``(y, rstd, x1 + x2)``, called ``y, _, residual = npu_add_rms_norm(x, residual, w, eps)``
  in vllm-project/vllm-ascend ``vllm_ascend/ops/layernorm.py``.
* ``npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> Tensor``: op-plugin
  ``docs/context/torch_npu-npu_rotary_mul.md`` (A2/A3, ``jit_compile=False``): 4-D input, half mode
  ``out = r1 * x + r2 * cat(-x2, x1)``, D even and < 896, B and N < 1000; for a BSND input r1/r2 are
  1S1D, BS1D or BSND; vllm-ascend ``ops/rotary_embedding.py`` passes x ``[1, T, N, D]`` and cos/sin
  ``[1, T, 1, D]``.
* ``npu_swiglu(Tensor self, int dim=-1) -> Tensor``: op-plugin SwiGlu op page (torch_npu >= 2.6.0,
  A2/A3, float16/bfloat16/float32, 1-8 dims): ``silu(a) * b`` with ``a, b = self.chunk(2, dim)``,
  as vllm-ascend ``ops/activation.py`` (``AscendSiluAndMul``) uses it on ``[gate | up]``.

Math runs in float32 and rounds each output once to the input dtype.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OPS = ("npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu")


class NpuOpError(RuntimeError):
    """What a real op reports as an aclnn error (a RuntimeError in torch_npu)."""


def _dtype(name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> None:
    if t.dtype not in DTYPES:
        raise NpuOpError(f"{name} dtype must be float16/bfloat16/float32, got {t.dtype}")
    if like is not None and t.dtype != like.dtype:
        raise NpuOpError(f"{name} dtype {t.dtype} must equal self's {like.dtype}")


def _norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not 2 <= x.dim() <= 8:
        raise NpuOpError(f"self must have 2-8 dims, got {x.dim()}")
    _dtype("self", x)
    _dtype("gamma", gamma, x)
    k = gamma.dim()
    if k > x.dim() or tuple(x.shape[-k:]) != tuple(gamma.shape):
        raise NpuOpError(f"gamma shape {tuple(gamma.shape)} must equal self's trailing dims {tuple(x.shape)}")
    dims = tuple(range(x.dim() - k, x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06) -> tuple[torch.Tensor, torch.Tensor]:
    return _norm(self, gamma, epsilon)


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x1.shape != x2.shape:
        raise NpuOpError(f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must have one shape")
    _dtype("x2", x2, x1)
    x = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = _norm(x, gamma, epsilon)
    return y, rstd, x


def npu_rotary_mul(self: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    if rotary_mode != "half":
        raise NotImplementedError(f"rotary_mode {rotary_mode!r} is not emulated (half only)")
    if self.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise NpuOpError(f"self, r1 and r2 must be 4-D, got {self.dim()}/{r1.dim()}/{r2.dim()}")
    _dtype("self", self)
    _dtype("r1", r1, self)
    _dtype("r2", r2, self)
    b, s, n, d = self.shape  # BSND, the layout vllm-ascend passes
    if d % 2 or d >= 896 or b >= 1000 or n >= 1000:
        raise NpuOpError(f"half mode needs D even and < 896, B and N < 1000, got {tuple(self.shape)}")
    for name, r in (("r1", r1), ("r2", r2)):
        if r.shape != r1.shape or tuple(r.shape) not in ((1, s, 1, d), (b, s, 1, d), (b, s, n, d)):
            raise NpuOpError(f"{name} shape {tuple(r.shape)}: for a BSND self {tuple(self.shape)} it must be "
                             "1S1D, BS1D or BSND (r1 and r2 alike)")
    x = self.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (r1.float() * x + r2.float() * torch.cat((-x2, x1), dim=-1)).to(self.dtype)


def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if not 1 <= self.dim() <= 8:
        raise NpuOpError(f"self must have 1-8 dims, got {self.dim()}")
    _dtype("self", self)
    if self.shape[dim] % 2:
        raise NpuOpError(f"self.shape[{dim}] = {self.shape[dim]} must be even (split into two halves)")
    a, b = self.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(self.dtype)

"""Split-K linear for forwards of many tokens whose output tiles leave SMs idle (:mod:`hwkv_cuda.kernels.gemm`).

``HWKV_CUDA_GEMM`` switches it: ``0`` (the default) leaves every projection to cuBLAS, ``1`` takes the shapes
:func:`choose` accepts. Off because it lost: on one H200, the 1B offline workload at the public defaults in one engine,
two rounds each, prefix cache reset before every run (bench/results/issue36-s8-perf-b1-H200-2026-11-29-e80f843.md):
1.422 / 1.423 s with it against 1.287 / 1.282 s with cuBLAS (10.6% slower). (Session 7's A/B of it compared runs
with a warm prefix cache.) Kept as the probe's subject for a TMA / warp-specialised tile. ``HWKV_CUDA_GEMM_CONFIG``
(``"block_m=128,block_n=128,block_k=64,split_k=4,num_warps=8,num_stages=4"``) overrides the tile for sweeps
(``backends/cuda/scripts/gemm_probe.py``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from hwkv_cuda.launch import device_limits, parse_overrides

ENV = "HWKV_CUDA_GEMM"
CONFIG_ENV = "HWKV_CUDA_GEMM_CONFIG"
MIN_TOKENS = 16  # fewer rows: the decode ops' GEMV (or cuBLAS) - an MMA tile of 64 rows would be mostly empty
MAX_TOKENS = 2048  # more rows fill the SMs with whole tiles already
COUNTERS = 1 << 12  # output tiles one launch may have (one arrival counter each, per device)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 8
    num_stages: int = 4


def choose(m: int, n: int, k: int, num_sms: int) -> GemmConfig | None:
    """The tile for ``[m, k] @ [n, k].T``, or ``None`` where cuBLAS keeps it: a grid of 128 x 128 tiles that
    already fills the SMs, or no split that divides K into whole tiles of at least 256 keys. The split is the
    largest of 8, 4, 2 that keeps all programs in one wave."""
    block_m = 64 if m <= 64 else 128
    tiles = -(-m // block_m) * -(-n // 128)
    if not MIN_TOKENS <= m <= MAX_TOKENS or tiles * 2 > num_sms:
        return None
    for split in (8, 4, 2):
        if tiles * split <= num_sms and k % (split * 64) == 0 and k // split >= 256:
            return GemmConfig(block_m, 128, 64, split, 8 if block_m == 128 else 4, 4)
    return None


class SplitKLinear:
    """``y = x @ weight.T + bias`` (``x [M, K]``, ``weight [N, K]``, 16-bit, contiguous rows), or ``None`` where
    it does not apply (switched off, a shape :func:`choose` leaves to cuBLAS, another dtype or layout, or a graph
    capture before the counters of this device and stream exist: the first eager call on it allocates them)."""

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        # per device and stream, zeroed once; every launch leaves them zero. Per stream: two split-K launches that
        # ran at once (streams of one device) would count into each other's tiles
        self._cnt: dict[tuple[torch.device, int], torch.Tensor] = {}

    def config(self, x: torch.Tensor, weight: torch.Tensor) -> GemmConfig | None:
        over = parse_overrides(CONFIG_ENV, GemmConfig._fields)
        m, k = x.shape
        cfg = choose(m, weight.shape[0], k, device_limits(x.device)[0])
        if over:
            cfg = (cfg or GemmConfig(128, 128, 64, 1))._replace(**over)
        return cfg

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
        from hwkv_cuda.kernels.gemm import gemm_kernel

        if os.environ.get(ENV, "0") != "1" or x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            return None
        if (x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype or x.stride(1) != 1
                or weight.stride(1) != 1 or x.device.type != self.device_type or weight.device != x.device
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return None
        cfg = self.config(x, weight)
        (m, k), n = x.shape, weight.shape[0]
        if cfg is None or k % (cfg.split_k * cfg.block_k):
            return None
        tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
        cnt = None
        if cfg.split_k > 1:
            if tiles > COUNTERS:
                return None
            key = (x.device, torch.cuda.current_stream(x.device).cuda_stream if x.device.type == "cuda" else 0)
            cnt = self._cnt.get(key)
            if cnt is None:
                if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                    return None  # (a capture's warm-up pass on its stream allocates them)
                cnt = self._cnt[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=x.device)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device) if cfg.split_k > 1 else y
        gemm_kernel[(tiles, cfg.split_k)](
            x, weight, y, bias if bias is not None else y, part, cnt if cnt is not None else y, m, n, k,
            x.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        return y

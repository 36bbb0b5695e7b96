"""Launch of the Gluon fp8-KV decode kernel (:mod:`hwkv_cuda.kernels.attention_fp8g`), the default decode over an
fp8 cache wherever it applies (issue #36); ``HWKV_CUDA_FP8G=0`` turns it off (the unified kernel's tiles, for A/B).

It takes a step where: the query is on a CUDA device (Gluon has no interpreter) and 16-bit, the step is a pure
decode (one query token per request) of at least ``min_keys`` keys (requests x the longest context: below that its
split grid of one-warp programs and second launch cost more than the unified kernel's tiles - one layer of the 1B
shape on an H200, 1 x 1k 23.7 vs 16.3 us, 8 x 1k 24.0 vs 16.6, 1 x 8k 24.0 vs 18.9; from 32k keys on it won every
shape, 1 x 32k 26.7 vs 29.7 up to 128 x 32k 977 vs 2,165), the cache is fp8 with 16-token blocks stored contiguous
(V pages ``[H_kv, D, 16]``), head size 64 or 128, an even number of KV heads, a GQA group of at most 8, no sliding
window, soft-cap or sinks. Every other step keeps the unified kernel. ``HWKV_CUDA_FP8G_CONFIG`` (``"stages=3"``, read
per call) tunes it: ``stages`` tiles in flight (two blocks a tile), ``split_target`` one-warp programs per SM the
splits aim at (0: as many as the shared memory lets reside, rounded down to whole programs, so the grid is one wave -
at 32 x 32k on an H200 1,024 programs on 1,056 places, where a ceiling of 7 a SM gave 1,024 programs on 792),
``splits`` (a fixed count; 0: from ``split_target``), ``min_split`` fewest keys per split and ``min_keys`` (16,384)
the smallest decode it takes. The partials are merged by the unified kernel's ``reduce_kernel`` in a second launch.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from hwkv_cuda.launch import parse_overrides
from hwkv_cuda.tiles import MAX_SPLITS, pow2

ENV = "HWKV_CUDA_FP8G"
CONFIG_ENV = "HWKV_CUDA_FP8G_CONFIG"
DEFAULTS = dict(stages=3, split_target=0, splits=0, min_split=512, min_keys=16384)
HEADS = 2  # KV heads a program (the kernel's NH)
BLOCK_N = 32  # keys a tile: two 16-token blocks (the kernel's NB * BS)
SM_SHARED = 233472  # shared memory of an sm_90 SM (228 KiB); 1 KiB of it per resident block is the driver's
MAX_WARPS_BY_REGS = 16  # 65,536 registers an SM over the kernel's 128 a thread
LOG2E = 1.4426950408889634  # the softmax runs in base 2 (as the unified kernel's)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def config() -> dict[str, int]:
    cfg = dict(DEFAULTS)
    cfg.update(parse_overrides(CONFIG_ENV, DEFAULTS))
    if cfg["stages"] < 2:
        raise ValueError(f"{CONFIG_ENV}: stages must be >= 2 (one tile landing while one is read), got {cfg['stages']}")
    return cfg


@functools.cache
def gluon_available() -> bool:
    """Whether this Triton has the Gluon names the kernel uses (``triton>=3.4`` is declared; Gluon is experimental
    and its API moved between releases): without them every step keeps the unified kernel."""
    try:
        import hwkv_cuda.kernels.attention_fp8g  # noqa: F401
    except (ImportError, AttributeError):
        return False
    return True


def applies(impl: Any, query: torch.Tensor, layer_kv: torch.Tensor, md: Any) -> bool:
    """Whether this step may take the Gluon kernel (module doc), ``HWKV_CUDA_FP8G`` aside."""
    _, _, bs, hkv, d = layer_kv.shape
    c = md.common
    return (query.is_cuda and gluon_available() and md.one_token and c.num_reqs * c.max_seq_len >= config()["min_keys"]
            and query.dtype in (torch.float16, torch.bfloat16) and d in (64, 128) and bs == 16
            and hkv % HEADS == 0 and impl.num_heads // hkv <= 8 and layer_kv.stride(3) == d
            and layer_kv.stride(2) == hkv * d and query.stride(-1) == 1 and query.stride(1) == d
            and impl.window is None and impl.softcap is None and impl.sinks is None)


def resident(stages: int, head_bytes: int) -> int:
    """One-warp programs an SM holds: shared memory (``stages`` tiles of a ``[32, head_bytes]`` K tile and two
    ``[head_bytes, 16]`` V pages, plus ~1 KiB of the layout conversions' scratch) or registers, the fewer."""
    smem = stages * 4 * 16 * head_bytes + 1024
    return max(1, min(SM_SHARED // (smem + 1024), MAX_WARPS_BY_REGS))


def splits_for(md: Any, per_request: int, block_n: int, split_target: int, min_split: int, fixed: int = 0) -> int:
    """Splits of each of a request's ``per_request`` programs: ``fixed``, or enough for ``split_target`` programs per
    SM (a negative value: at most ``-split_target`` per SM, rounded down - whole waves), at most one per ``min_split``
    keys of the longest request and ``MAX_SPLITS``; then whole tiles of ``block_n`` keys per split and no empty split
    of the longest request."""
    c = md.common
    max_len = max(c.max_seq_len, 1)
    programs = max(1, c.num_reqs * per_request)
    per_sm = (-split_target * md.num_sms // programs) if split_target < 0 else -(-split_target * md.num_sms // programs)
    splits = fixed or min(per_sm, max_len // max(min_split, 1))
    splits = max(1, min(MAX_SPLITS, splits))
    seg = -(-max_len // splits)
    seg = -(-seg // block_n) * block_n
    return -(-max_len // seg)


def forward_fp8g(impl: Any, out: torch.Tensor, query: torch.Tensor, layer_kv: torch.Tensor, md: Any) -> None:
    from hwkv_cuda.kernels.attention import reduce_kernel
    from hwkv_cuda.kernels.attention_fp8g import fp8g_decode_kernel

    c = md.common
    cfg = config()
    _, _, bs, hkv, d = layer_kv.shape
    group = impl.num_heads // hkv
    target = cfg["split_target"] or -resident(cfg["stages"], HEADS * d)  # negative: a ceiling, one wave
    splits = splits_for(md, hkv // HEADS, BLOCK_N, target, cfg["min_split"], cfg["splits"])
    splits_pad = pow2(splits)
    n = query.shape[0]
    part_acc = torch.empty((n, impl.num_heads, splits_pad, d), dtype=torch.float32, device=query.device)
    part_ml = torch.empty((n, impl.num_heads, splits_pad, 2), dtype=torch.float32, device=query.device)
    scales = impl.scales_for(layer_kv)
    min_seg = -(-max(cfg["min_split"], 1) // BLOCK_N) * BLOCK_N  # as CudaAttentionMetadata.plan's
    fp8g_decode_kernel[(c.num_reqs, hkv // HEADS, splits)](
        query, layer_kv, part_acc, part_ml, c.seq_lens, c.block_tables, scales,
        min_seg, impl.scale * LOG2E, scales.stride(0), query.stride(0),
        layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(2), c.block_tables.stride(0),
        HKV=hkv, G=group, D=d, BS=bs, STAGES=cfg["stages"], NUM_SPLITS_PAD=splits_pad, num_warps=1,
    )
    reduce_kernel[(n, impl.num_heads)](
        out, part_acc, part_ml, out.stride(0), out.stride(1), impl.num_heads, splits,
        HEAD_SIZE=d, D_PAD=d, NUM_SPLITS_PAD=splits_pad, num_warps=4,
    )

"""Launch of the transposed fp8-KV decode kernel (:mod:`hwkv_cuda.kernels.attention_fp8t`), an A/B route for
issue #36 behind ``HWKV_CUDA_FP8T=1`` (off by default). The Gluon kernel (:mod:`hwkv_cuda.attention_fp8g`) is
checked first: where it applies, time this route with ``HWKV_CUDA_FP8G=0`` as well.

It takes a step only where it applies: an fp8 cache, a pure decode (one query token per request), a 16-bit query,
a power-of-two head size of 16-128, no sliding window, soft-cap or sinks; every other step keeps the unified kernel.
``HWKV_CUDA_FP8T_CONFIG`` (``"num_warps=4,block_n=128"``, read per call) tunes it: ``block_n`` keys per tile (a power
of two >= 16; at 4 warps a multiple of 64, M of one wgmma per warpgroup), ``num_warps``, ``num_stages``,
``split_target`` programs per SM the splits aim at, ``splits`` (a fixed count; 0: from ``split_target``),
``min_split`` fewest keys per split, ``lacc`` (the softmax sum kept per key row, reduced once after the loop: the
kernel's ``LACC``) and ``maxnreg`` (Triton's register cap per thread; 0: none).
Splits follow :meth:`hwkv_cuda.attention.CudaAttentionMetadata.plan`'s rounding: whole tiles, no empty split for
the longest request; the reduction is the unified kernel's (fused or a second launch, ``HWKV_CUDA_SPLIT_REDUCE``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hwkv_cuda.launch import parse_overrides, use_pdl
from hwkv_cuda.splitkv import merge_tile, reduce_mode
from hwkv_cuda.tiles import MAX_SPLITS, pow2

ENV = "HWKV_CUDA_FP8T"
CONFIG_ENV = "HWKV_CUDA_FP8T_CONFIG"
# one warp, 64 keys, 5 stages, split_target 15 (8 splits of the 256 (request, KV head) pairs at 32 x 32k): the fastest
# of 28 tiles on an H200 (docs/fp8-kv-cache.md, session 10); the 4-warp wgmma tiles were 491-1000 us against 396 at 1B
DEFAULTS = dict(block_n=64, num_warps=1, num_stages=5, split_target=15, splits=0, min_split=512, lacc=1, maxnreg=0)
LOG2E = 1.4426950408889634


def enabled() -> bool:
    return os.environ.get(ENV, "0") == "1"


def config() -> dict[str, int]:
    cfg = dict(DEFAULTS)
    cfg.update(parse_overrides(CONFIG_ENV, DEFAULTS))
    if cfg["block_n"] < 16 or cfg["block_n"] != pow2(cfg["block_n"]):
        raise ValueError(f"{CONFIG_ENV}: block_n must be a power of two >= 16, got {cfg['block_n']}")
    return cfg


def applies(impl: Any, query: torch.Tensor, layer_kv: torch.Tensor, md: Any) -> bool:
    """Whether this step may take the transposed kernel (module doc), ``HWKV_CUDA_FP8T`` aside."""
    d = impl.head_size
    return (md.one_token and query.dtype in (torch.float16, torch.bfloat16) and 16 <= d <= 128 and d == pow2(d)
            and impl.window is None and impl.softcap is None and impl.sinks is None
            and impl.num_heads // impl.num_kv_heads <= 16)


def splits_for(md: Any, hkv: int, block_n: int, split_target: int, min_split: int, fixed: int = 0) -> int:
    """Splits per (request, KV head): ``fixed``, or enough for ``split_target`` programs per SM (a negative value:
    at most ``-split_target`` per SM, rounded down), at most one per ``min_split`` keys of the longest request and
    ``MAX_SPLITS``; then whole tiles per split and no empty split."""
    c = md.common
    max_len = max(c.max_seq_len, 1)
    programs = max(1, c.num_reqs * hkv)
    # a negative split_target: that many programs per SM as a ceiling on the grid (whole waves), not a goal
    per_sm = (-split_target * md.num_sms // programs) if split_target < 0 else -(-split_target * md.num_sms // programs)
    splits = fixed or min(per_sm, max_len // max(min_split, 1))
    splits = max(1, min(MAX_SPLITS, splits))
    seg = -(-max_len // splits)
    seg = -(-seg // block_n) * block_n
    return -(-max_len // seg)


def forward_fp8t(impl: Any, out: torch.Tensor, query: torch.Tensor, layer_kv: torch.Tensor, md: Any) -> None:
    from hwkv_cuda.kernels.attention import reduce_kernel
    from hwkv_cuda.kernels.attention_fp8t import fp8t_decode_kernel

    c = md.common
    cfg = config()
    nb, _, bs, hkv, d = layer_kv.shape
    if layer_kv.stride(3) != d or layer_kv.stride(2) != hkv * d:
        raise ValueError("an fp8 cache's V pages are [H_kv, D, block_size] (hwkv.interfaces.kv_quant): its blocks "
                         f"must be contiguous, got strides {layer_kv.stride()}")
    group = impl.num_heads // hkv
    splits = splits_for(md, hkv, cfg["block_n"], cfg["split_target"], cfg["min_split"], cfg["splits"])
    fused = reduce_mode() == "fused" and splits > 1
    splits_pad = pow2(splits)
    g_pad = pow2(group)
    merge_rows, merge_splits = merge_tile(1, g_pad, splits_pad, d, cfg["num_warps"], 32) if fused else (1, 1)
    n = query.shape[0]
    if splits > 1:
        part_acc = torch.empty((n, impl.num_heads, splits_pad, d), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((n, impl.num_heads, splits_pad, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out
    counters = impl.counters.get(query.device, c.num_reqs * hkv) if fused else out
    scales = impl.scales_for(layer_kv)
    pdl = use_pdl(query.device)
    fp8t_decode_kernel[(hkv, c.num_reqs, splits)](
        query, layer_kv, out, part_acc, part_ml, counters, c.seq_lens, c.block_tables, scales,
        impl.scale * LOG2E, scales.stride(0), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(2), layer_kv.stride(3), c.block_tables.stride(0),
        G=group, HEAD_SIZE=d, BS=bs, BLOCK_N=cfg["block_n"], N_PAD=16, SPLIT=splits > 1, FUSED=fused,
        NUM_SPLITS_PAD=splits_pad, G_PAD=g_pad, MERGE_ROWS=merge_rows, MERGE_SPLITS=merge_splits, PDL=pdl,
        LACC=bool(cfg["lacc"]),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **({"launch_pdl": True} if pdl else {}),
        **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] else {}),
    )
    if splits > 1 and not fused:
        reduce_kernel[(n, impl.num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1), impl.num_heads, splits,
            HEAD_SIZE=d, D_PAD=d, NUM_SPLITS_PAD=splits_pad, num_warps=4,
        )

"""Tile shapes of the attention kernel: chosen from the shape alone (:func:`choose_config`), overridable
through ``HWKV_CUDA_ATTN_CONFIG`` (``"BLOCK_N=128,num_warps=8"``) for tuning sweeps, and shrunk to the
device's shared memory (:func:`fit_shared_memory`) where a GPU has less than the H100s they were tuned on.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from hwkv_cuda.launch import parse_overrides

MAX_SPLITS = 64
SHORT_SPLIT = 128  # a split of at most this many keys runs as one tile
LONG_SPLIT = 512  # a split of at least this many keys runs 128-key tiles (fp8: int16 words, see choose_config)
FP8_LONG_SPLIT = 4096  # an fp8 split decode with splits this long takes the two-warp tile (choose_config)
OVERRIDE_ENV = "HWKV_CUDA_ATTN_CONFIG"
FP8_OVERRIDE_ENV = "HWKV_CUDA_ATTN_CONFIG_FP8"  # applied on top for an fp8 (1-byte) cache
DECODE_OVERRIDE_ENV = "HWKV_CUDA_ATTN_CONFIG_DECODE"  # applied on top for a decode step over a 16-bit cache
# the fp8 long-split decode tile where the all-heads kernel does not apply (a window, soft-cap or sinks): one warp
# per (request, KV head, split), 64 keys, five stages (choose_config's docstring, session 9)
ALL_HEADS_FALLBACK = dict(block_n=64, num_warps=1, num_stages=5, maxnreg=0)


def pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int
    split_below: int = 2  # split KV only when the grid has fewer programs than this per SM ...
    split_target: int = 8  # ... and then until it has this many per SM (half as many from a grid of at
    # most half the SMs: see CudaAttentionMetadata.plan)
    min_split: int = 128  # fewest KV tokens a split may get
    part_cap: int = 4  # fp32 partials (written + read) stay under KV bytes / part_cap (0: no cap)
    merge_cap: int = 0  # fused reduction: one merge reads <= one split's KV bytes / merge_cap (0: no cap;
    # the H100 A/B (bench/results/reduce-ab-H100-2026-11-21.json) found the cap slower at b1 ctx 8k)
    merge_regs: int = 32  # fp32 values per thread in one load of the fused merge
    max_splits: int = MAX_SPLITS  # most splits per (q block, KV head)
    head_major: int = 0  # grid (KV heads, q blocks, splits): a request's KV heads run side by side (A/B; q blocks
    # past 65,535 keep the q-major grid)
    direct: int = 1  # a step of one query token per request maps program to request without the binary search over
    # query_start_loc (0: search anyway, for A/B runs)
    fp8_unpack: int = 0  # how an fp8 cache's K is read (V always as [D, keys] tiles of its transposed pages,
    # hwkv.interfaces.kv_quant): 0 e4m3 tiles cast (K as [D, keys]); 1 int16 words of two codes unpacked in
    # registers (even head sizes); 2 e4m3 rows cast, K transposed after the cast; 3 as 1, with fp16 dots for a
    # bf16 query (the query scaled by 2^-8 into fp16 once per program); 4 as 0 and 6 as 2, the tiles cast to fp16
    # (one cvt.rn.f16x2.e4m3x2 per two codes on sm_89+) with 3's fp16 dots; 7 as 4 (it cast token-major V in its
    # loaded rows, before V's pages were transposed)
    prefetch: int = 0  # a decode tile (block_q 1) streams K/V software-pipelined by hand: the next tile's K/V rows
    # load while this tile's dots run, from block ids loaded one tile earlier (kernels/attention.py, PREFETCH);
    # over an fp8 cache its tiles are cast to fp16 for fp16 dots (as fp8_unpack 7)
    early: int = -1  # a pure decode (one query token per request) over a 16-bit cache loads its first K/V tile before
    # the PDL wait and only the query and this step's own K/V rows after it, and merges its splits in one pass
    # (kernels/attention.py, EARLY). -1 (auto): where every split is one tile (a small batch up to ~8k keys); H200,
    # batch-1 decode of the 1B shape in the engine: replay 0.887 -> 0.839 ms, 1,085 -> 1,143 tok/s (same run,
    # bench/results/issue36-b1-s8-batch1-H200-2026-11-29-e80f843.md). 0 / 1: off / on wherever it applies
    all_heads: int = 0  # a pure decode (one query token per request, no window / soft-cap / sinks) runs every KV head
    # of a request in one program (kernels/attention.py, decode_heads_kernel): a block's K rows are read whole, not
    # in head_size-wide pieces by one program per KV head; num_warps, block_n and num_stages are that kernel's, and
    # a layer it does not apply to runs these fields replaced by ALL_HEADS_FALLBACK
    maxnreg: int = 0  # registers per thread the attention launch may use (Triton's maxnreg; 0: the compiler's choice).
    # The fp8 long-split tile takes 138 (Nsight Compute, H200): 6 programs of 2 warps per SM, 18.75% occupancy;
    # capped at 128 / 112 / 96 it ran slower (450 vs 419 us, 32 x 32k,
    # fp8-decode-maxnreg-1b-32x32k-H200-2026-11-29-cbd2ac3.json)



def choose_config(max_query_len: int, group: int, head_size: int, dtype: torch.dtype,
                  split: bool = False, seg: int = 0, wide: bool = False, kv_elem: int = 0,
                  short: bool = False, full: bool = False) -> TileConfig:
    """Tiles by shape (from H100/H200 sweeps, docs/cuda-backend.md): decodes pack the G heads of a KV
    head into M (>= 16 rows for the MMA) and stream 64-key tiles three stages deep; prefills take
    128-row tiles (keys per tile and warps by grid size, below). Head 256 and fp32 shrink the tiles so
    the K/V stages fit shared memory. A split decode (small grid) takes 32-key tiles: a quarter of the
    shared memory, so every split of a small batch is resident at once instead of queueing in a second
    wave — unless its splits are short (``seg``, the longest split, <= ``SHORT_SPLIT``): then each is one
    128-key tile, since a split's time is its chain of dependent loads (block id → K → V) per tile, not its bandwidth
    (H100, batch 1: ctx 512 10.7 → 7.3 µs, ctx 4k 15.9 → 15.2 µs; bench/results/
    e2e-llama-1b-H100-2026-11-21-attn-tiles.md). Such a one-tile split runs unpipelined: three K/V
    stages of a 128-key tile took 192 KB of shared memory, one program per SM, for a loop of one
    iteration (H100 GQA b1 ctx 1k/4k/8k 9.1/15.7/22.7 → 7.7/12.6/21.5 µs, MHA b1 ctx 1k/4k 14.9/34.9 →
    12.0/31.8; longer splits keep three stages, as good or better from 8 tiles of 32 keys on; bench/results/
    attention-b1b8-stages-H100-2026-11-22.txt). A prefill grid of at least two programs per SM
    (``wide``) runs 4 warps over 64-key tiles, a smaller one 8 warps over 128-key tiles (H100, chunk 2k on
    a 16k prefix 2135 → 1659 µs MHA, 2011 → 1656 GQA; chunk 512 on 4k 151 → 138 µs MHA; square causal
    512 2-5 % slower; bench/results/attention-prefill-tiles-H100-2026-11-22.txt). At head size <= 64 the wide grid's
    128-row tiles take 8 warps as well (H200, one layer of the 1B shape, the offline workload's prompt steps: 32 x 512
    causal 226.1 -> 203.1 µs, 32 decodes + 31 x 512 prompts 249.2 -> 226.4 µs, the same bits; 128-key tiles with 8
    warps 328 / 353, 256-row tiles 256 / 301; bench/results/issue36-s9-perf-b1-H200-2026-11-29-869ec68.md). Head 128
    and the 64-row tiles of mostly-decode steps keep 4 (not measured with 8).

    Decode tiles since the H200 sweep of 2026-11-28 (bench/results/issue36-round3-H200-2026-11-28-918b7a9.md):
    a split decode whose splits are at least ``LONG_SPLIT`` keys takes 128 keys (the 32-key tile above
    was 1.2-1.5x slower at every measured shape, all with splits of >= 512 keys: 1B b1 x 32k, b4 x 8k/32k,
    b32 x 32k, 8B b32 x 32k; 128 keys read 96-97% of the copy bandwidth at 32 x 32k); splits of 129-511
    keys keep 32 (the H100 case above); an unsplit decode of head size <= 64 takes 128 (256 x 1k:
    170 -> 149 µs); head 128 unsplit keeps 64 keys (not measured).

    ``kv_elem`` is the KV cache's element size (0: ``dtype``'s). A split decode over a 1-byte (fp8)
    cache with splits of >= ``LONG_SPLIT`` keys casts its e4m3 tiles to fp16 (two codes per
    ``cvt.rn.f16x2.e4m3x2``) and runs fp16 dots: rows of 256 keys with K transposed after the cast
    (``fp8_unpack=6``) at head size <= 64, ``[D, keys]`` tiles of 128 keys (``fp8_unpack=4``) above.
    H200, one layer at 32 x 32k (bench/results/issue36-batch3-H200-2026-11-28-d0dcc93.md): 1B shape
    539 -> 495 µs against the int16-word read of before (``fp8_unpack=3``; 1.09x the bf16 cache's 540),
    8B shape 921 -> 907 µs (1.20x bf16's 1092); the e4m3 tiles cast to bf16 stayed at <= 40% of the copy
    bandwidth. None is bound by bytes (52-57% of the copy bandwidth on half the bytes). An unsplit fp8
    decode keeps 128 keys cast (not measured).

    Splits of >= ``FP8_LONG_SPLIT`` keys at head size <= 64 (a full grid of long requests: 32 x 32k plans splits of
    6.5k keys) take two warps per program, 64-key tiles with V cast in its rows (``fp8_unpack=7``), five stages,
    ``split_target=16`` and the head-major grid. H200, one layer of the 1B shape at 32 x 32k (bench/results/
    fp8-decode-warps-1b-32x32k-H200-2026-11-29-e4ece1f.json): 489 -> 390 µs, 55% -> 69% of the copy bandwidth
    (bf16 at its default tiles 521 µs, its best of five 505): the 16-row decode tile over 4 warps spends its
    time in cross-warp reductions and layout changes, not bytes (4 -> 2 warps alone: 497 from 595 µs in the
    prefetch probe; 8 warps: 855). Shorter splits and head 128 keep the tiles above (not measured with two warps).
    Since V pages are stored transposed (hwkv.interfaces.kv_quant, session 9) that tile takes **one warp** and
    ``split_target=15``: 8 splits of the 256 (request, KV head) pairs at 32 x 32k, 2,048 programs in two whole waves of
    8 per SM (246 registers), no cross-warp softmax. H200, one layer at 32 x 32k, same run (bench/results/
    issue36-s9-fp8-b2-H200-2026-11-29-26c4c8a.json): token-major V at the two-warp tile 420 / 418 µs, transposed V
    at the same tile 445 (batch 1), at one warp 410 (9 splits), **395** (8 splits), 400 (4 splits), two warps with
    6 splits 405; bf16 535.
    Since session 10 a pure decode there (one query token per request, no window / soft-cap / sinks) runs
    ``decode_heads_kernel`` (``all_heads=1``): one program per request and split reads every KV head, each block's K
    half as whole token rows (the one-warp tile read it as 64-byte head rows, 512 bytes apart, by 8 programs at
    unrelated times) and its V half as whole head pages; per head the keys run in the MMA's M dimension (the
    4-head group padded to 8 columns, not 16 rows). Four warps, 32-key tiles, five stages, 8 splits. H200, one
    layer at 32 x 32k, same run (bench/results/issue36-s10-fp8-b2-H200-2026-11-29-144b5b1.md): 397 -> 373 µs at three
    stages (8 warps capped at 128 registers 376, five stages 377, 16 splits 387; bf16 532); the engine's decode step
    with it 7.05 ms against bf16's 9.49 (1.35x). Batch 3, same run (bench/results/issue36-s10-fp8-b3-H200-2026-11-29-
    f8638ba.md): three stages 376 / 375, **five 370**, the one-warp tile 398, 6 / 12 splits 467 / 521; bf16 539. At
    head 128 (the 8B shape) it lost (8 warps 919-928 µs against that shape's fp8 tile, 890): head 128 keeps its tile.
    Layers with a window, soft-cap or sinks keep the one-warp tile (``ALL_HEADS_FALLBACK``). The keys-in-M one-warp
    tile alone (one program per KV head; 488 instead of 775 instructions a warp per 64 keys, twice the programs per
    SM) ran as fast as that tile (390-402 vs 391 µs, batch 1, bench/results/issue36-s10-fp8-b1-H200-2026-11-29-
    0d465d5.md) and was removed.

    A step of many tokens whose q blocks are mostly requests shorter than one block (``short``: decodes beside a
    prefill chunk, see ``CudaAttentionMetadata.mostly_short``) takes 64-row tiles instead of 128: a decode fills
    one token's rows of its tile, so half the rows are half the wasted MMA work and registers. H200, one layer of
    the 1B shape (bench/results/issue36-call1-H200-2026-11-28-8b3214a.md): 224 decodes at 600 keys + one
    512-token prefill 197 -> 125 µs; a prefill alone (32 x 512) is 8% slower with them (225 -> 242 µs), so only
    such steps take them.

    A decode whose unsplit grid fills the GPU (``full``: the plan splits nothing, e.g. the offline workload's 256
    requests x 8 KV heads) over a 16-bit cache at head size <= 64 runs one warp per program over 64-key tiles, three
    stages, on the head-major grid (a request's KV heads side by side, reading the same cache blocks at once): a
    quarter of the shared memory of the 128-key tile, so four programs per SM stream their requests' K/V instead of
    two. H200, one layer of the 1B shape at 256 requests (bench/results/issue36-s8-perf-b1-H200-2026-11-29-e80f843.md):
    544 / 640 / 768 keys 87.9 / 99.0 / 111.5 -> 78.3 / 88.4 / 103.4 µs with one warp (the best of 10 tiles); the
    head-major grid on top, another run (bench/results/issue36-s8-perf-b2-H200-2026-11-29-cbca144.md): 88.8 / 101.0 /
    119.7 -> 79.6 / 91.6 / 104.1 µs, 64 x 4096 keys 156.3 -> 137.7 (3.58-3.90 TB/s of K/V read, 86-94% of the copy
    bandwidth). The 1B offline workload in one engine, same run: 1.325 s (the 128-key four-warp tile) -> 1.290 (one
    warp) -> 1.275 (one warp, head-major).

    The same unsplit decode at head size 65-128 (Llama-3-8B's 128) runs **two** warps over its 64-key tiles. H200,
    one layer, 128 requests x 600 keys (bench/results/issue34-s10-tpoff-b2-H200-2026-11-29-e0ca6ab.md): a tp=2
    rank's heads (16/4) 72.4 -> 47.8 µs, tp=1's (32/8) 111.8 -> 84.3, 256 x 640 at the tp=2 rank's heads 116.9 ->
    90.6 (one warp 55.0 / 105.5 / 103.0, eight 68.4 / 105.5 / 109.5, 32-key tiles with two warps 51.8 / 110.8 / 119.4);
    the 8B offline workload at tp=1 in one engine, same run: 6,251 -> 6,410 output tok/s."""
    hpad = pow2(group)
    wide_kv = (kv_elem or dtype.itemsize) == 1 and dtype != torch.float32  # fp8 KV read by a 16-bit query
    narrow = head_size > 128 or dtype == torch.float32
    if max_query_len == 1:
        block_m = max(16, hpad)
        one_tile = split and not narrow and 0 < seg <= SHORT_SPLIT
        unpack = 0
        if narrow:
            block_n = 32
        elif one_tile:
            block_n = SHORT_SPLIT
        elif split and seg < LONG_SPLIT:  # 2-3 tiles of 128 keys were slower than 32-key ones (H100 b1 16k)
            block_n = 64 if wide_kv else 32
        elif wide_kv and split:  # fp8: e4m3 tiles cast to fp16 (cvt.rn.f16x2.e4m3x2), fp16 dots (module doc)
            block_n, unpack = (256, 6) if head_size <= 64 else (128, 4)
        elif wide_kv:
            block_n = 128
        else:
            block_n = 128 if split or head_size <= 64 else 64
        # one tile has no loop to pipeline: three stages would only take shared memory (residency)
        cfg = dict(block_m=block_m, block_q=1, block_n=block_n, num_warps=4, num_stages=1 if one_tile else 3,
                   fp8_unpack=unpack)
        if full and not split and not wide_kv and not narrow and head_size <= 64:
            cfg.update(block_n=64, num_warps=1, head_major=1)  # a full grid of unsplit decodes (docstring)
        elif full and not split and not wide_kv and not narrow:
            cfg.update(num_warps=2)  # head 65-128, unsplit: two warps over the 64-key tiles (docstring)
        if wide_kv and split and head_size <= 64 and seg >= FP8_LONG_SPLIT:
            # fp8, a full grid of long splits (docstring): one warp per program, 64-key tiles, five stages (two
            # K/V buffers in flight behind the block-table load), 15 programs per SM's worth of splits (whole
            # waves at 8 programs per SM), the KV heads of a request side by side
            cfg.update(block_n=64, fp8_unpack=7, num_warps=1, num_stages=5, split_target=15, head_major=1)
            # since session 10 a pure decode there runs every KV head of a request in one program (docstring)
            cfg.update(all_heads=1, block_n=32, num_warps=4, num_stages=5)
    else:
        block_m = max(64 if narrow or short else 128, hpad)
        if narrow:
            cfg = dict(block_m=block_m, block_q=block_m // hpad, block_n=32, num_warps=8 if block_m >= 128 else 4,
                       num_stages=2)
        else:  # a small grid has SMs to spare: wider tiles, more warps per program
            # a wide grid of 128-row tiles at head size <= 64 runs 8 warps too (docstring: H200, session 9)
            warps8 = not wide or (head_size <= 64 and block_m == 128 and not short)
            cfg = dict(block_m=block_m, block_q=block_m // hpad, block_n=64 if wide else 128,
                       num_warps=8 if warps8 else 4, num_stages=3)
    cfg.update(overrides(fp8=(kv_elem or dtype.itemsize) == 1, decode=max_query_len == 1))
    if cfg["block_m"] // cfg["block_q"] < group:
        raise ValueError(f"tile config {cfg}: block_m // block_q must be >= the GQA group {group}")
    return TileConfig(**cfg)


def overrides(fp8: bool = False, decode: bool = False) -> dict[str, int]:
    """``HWKV_CUDA_ATTN_CONFIG`` (``"block_n=128,num_warps=8"``) as a dict (read per call); names are
    :class:`TileConfig`'s fields. ``fp8``: a launch over a 1-byte cache, where
    ``HWKV_CUDA_ATTN_CONFIG_FP8`` is applied on top (one process can time both caches, each with its own).
    ``decode``: a step of one query token per request, where ``HWKV_CUDA_ATTN_CONFIG_DECODE`` is applied on top
    over a 16-bit cache (an engine A/B of decode tiles leaves the prefill and mixed steps' tiles alone)."""
    names = [f.name for f in fields(TileConfig)]
    out = parse_overrides(OVERRIDE_ENV, names)
    if decode and not fp8:
        out.update(parse_overrides(DECODE_OVERRIDE_ENV, names))
    if fp8:
        out.update(parse_overrides(FP8_OVERRIDE_ENV, names))
    return out


def smem_bytes(cfg: TileConfig, d_pad: int, elem_size: int, kv_elem: int = 0) -> int:
    """Shared memory the kernel's tiles take, estimated: the Q tile (``elem_size`` bytes an element) and
    ``num_stages`` K and V tiles (``kv_elem``; 0: ``elem_size``)."""
    return (cfg.block_m * elem_size + 2 * cfg.num_stages * cfg.block_n * (kv_elem or elem_size)) * d_pad


def fit_shared_memory(cfg: TileConfig, d_pad: int, elem_size: int, limit: int, kv_elem: int = 0) -> TileConfig:
    """``cfg`` shrunk until :func:`smem_bytes` fits ``limit`` (0: unknown, keep it): stages down to two
    (the pipeline), then half the keys per tile down to 16, then one stage. The tiles were tuned on
    H100s (227 KB per block), where nothing shrinks; an A100 (163 KB) drops the 128-key prefill tile to
    two stages and a 99 KB GPU (sm_86/89) to 64 keys, and the three-stage decode tiles of a 99 KB GPU
    run two. Fields set by ``HWKV_CUDA_ATTN_CONFIG`` are never changed (a sweep row runs what it is
    labelled with). Raises ``ValueError`` when even the smallest tile does not fit."""
    if limit <= 0:
        return cfg
    fixed = overrides(fp8=(kv_elem or elem_size) == 1, decode=cfg.block_q == 1)
    for rule in ("stages", "keys", "one stage"):
        while smem_bytes(cfg, d_pad, elem_size, kv_elem) > limit:
            if rule == "stages" and cfg.num_stages > 2 and "num_stages" not in fixed:
                cfg = replace(cfg, num_stages=cfg.num_stages - 1)
            elif rule == "keys" and cfg.block_n > 16 and "block_n" not in fixed:
                cfg = replace(cfg, block_n=cfg.block_n // 2)
            elif rule == "one stage" and cfg.num_stages > 1 and "num_stages" not in fixed:
                cfg = replace(cfg, num_stages=1)
            else:
                break
    if (need := smem_bytes(cfg, d_pad, elem_size, kv_elem)) > limit:
        raise ValueError(f"attention tile {cfg} needs ~{need} bytes of shared memory; the device allows {limit} "
                         f"per block (head size {d_pad} padded, {elem_size}-byte elements"
                         + (f"; {OVERRIDE_ENV} fixes {sorted(fixed)}" if fixed else "") + ")")
    return cfg

"""CUDA attention: metadata planning and the launches of the Triton kernels.

Tile shapes come from :mod:`hwkv_cuda.tiles` (the shape, the grid, the device's shared memory;
``HWKV_CUDA_ATTN_CONFIG`` overrides them for tuning sweeps). Everything host-side is computed
from the ``*_cpu`` tensors, so a forward never syncs the device and can be captured in a CUDA graph.
``HWKV_CUDA_SPLIT_REDUCE`` picks the split-KV reduction (:mod:`hwkv_cuda.splitkv`);
``HWKV_CUDA_CHECK_SLOTS=1`` makes ``write_kv`` validate slots on the host (a device sync).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, NamedTuple

import torch

from hwkv.interfaces.attention import AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder
from hwkv.interfaces.kv_quant import is_quantized
from hwkv.interfaces.layout import KVLayoutKind
from hwkv_cuda import attention_fp8g as fp8g
from hwkv_cuda.elementwise import PDL_ENV as ELEMENTWISE_PDL_ENV
from hwkv_cuda.launch import device_limits, use_pdl
from hwkv_cuda.splitkv import SplitCounters, merge_tile, reduce_mode
from hwkv_cuda.tiles import (
    ALL_HEADS_FALLBACK,
    DECODE_OVERRIDE_ENV,
    FP8_OVERRIDE_ENV,
    MAX_SPLITS,
    OVERRIDE_ENV,
    TileConfig,
    choose_config,
    fit_shared_memory,
    pow2,
)

LOG2E = 1.4426950408889634
CHECK_SLOTS_ENV = "HWKV_CUDA_CHECK_SLOTS"


class Plan(NamedTuple):
    grid: int  # q blocks in the grid (an upper bound; surplus blocks do nothing)
    splits: int  # KV splits per program (grid axis 2)
    min_seg: int  # fewest keys per split (whole BLOCK_N tiles); the kernel sizes each request's own


class PlanKey(NamedTuple):
    block_q: int
    block_n: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    elem_size: int
    split_below: int
    split_target: int
    min_split: int
    part_cap: int
    merge_cap: int
    max_splits: int


@dataclass
class CudaAttentionMetadata:
    """Core metadata plus the step's tile choices and launch plans (host integers only: a captured
    graph keeps reading the caller's metadata tensors and nothing of ours). ``smem``: the device's
    opt-in shared memory per block (0: unknown, tiles are not shrunk)."""

    common: AttentionMetadata
    num_sms: int
    smem: int = 0
    plans: dict[PlanKey, Plan] = field(default_factory=dict)
    launches: dict[tuple[Any, ...], tuple[TileConfig, Plan]] = field(default_factory=dict)

    def q_blocks(self, block_q: int) -> int:
        """Programs along the grid's q axis: an upper bound (request boundaries may add one each)."""
        num_tokens = int(self.common.query_start_loc_cpu[-1])
        return num_tokens if block_q == 1 else num_tokens // block_q + self.common.num_reqs

    def programs(self, block_q: int, num_kv_heads: int) -> int:
        """Programs with work before any split: each request's q blocks times the KV heads."""
        qlen = self.common.query_lens_cpu.to(torch.int64)
        return max(1, int(((qlen + block_q - 1) // block_q).sum()) * num_kv_heads)

    @cached_property
    def one_token(self) -> bool:
        """Every request runs exactly one query token (a pure decode; the decode graphs' metadata too): the
        kernel's program ``i`` is request ``i``, with no binary search over ``query_start_loc`` (8 dependent
        loads at batch 256 before a program reads its first key)."""
        c = self.common
        return c.max_query_len == 1 and int(c.query_start_loc_cpu[-1]) == c.num_reqs

    def mostly_short(self, block_q: int) -> bool:
        """More than half the step's q blocks of ``block_q`` tokens belong to requests shorter than one block
        (decodes beside a prefill chunk): most tile rows would be empty (:func:`hwkv_cuda.tiles.choose_config`)."""
        qlen = self.common.query_lens_cpu.to(torch.int64)
        return 2 * int((qlen < block_q).sum()) > int(((qlen + block_q - 1) // block_q).sum())

    def plan(self, block_q: int, block_n: int, num_heads: int, num_kv_heads: int, head_size: int, elem_size: int,
             split_below: int = 2, split_target: int = 8, min_split: int = 128, part_cap: int = 4,
             merge_cap: int = 0, max_splits: int = MAX_SPLITS) -> Plan:
        """Launch plan for one tile shape, from host values only, cached. Splits (flash-decoding) only
        when the grid has fewer than ``split_below`` programs per SM, and then the fewest of:
        ``split_target`` programs per SM (``max(1, split_target // 2)`` when the unsplit grid fills at most
        half the SMs, also for an overridden ``split_target``); ``max_seq_len // min_split`` (no split shorter than
        ``min_split``); ``max_splits``; fp32 partials (written + read) under the KV bytes / ``part_cap``;
        and with ``merge_cap`` (fused reduction) the merge one program does after its own split,
        ``S * BLOCK_Q * G * D * 4`` bytes, under that split's KV bytes ``L / S * D * 2 * elem`` /
        ``merge_cap``. The segment is then rounded to whole tiles and the count recomputed, so the
        longest request has no empty split."""
        key = PlanKey(block_q, block_n, num_heads, num_kv_heads, head_size, elem_size, split_below, split_target,
                      min_split, part_cap, merge_cap, max_splits)
        if key not in self.plans:
            c = self.common
            num_tokens = int(c.query_start_loc_cpu[-1])
            grid = self.q_blocks(block_q)
            programs = self.programs(block_q, num_kv_heads)
            # a grid that already fills the SMs loses more to partials and their merge than it gains
            splits = 1
            max_len = max(c.max_seq_len, 1)
            if programs < split_below * self.num_sms:
                kv_bytes = int(c.seq_lens_cpu.sum()) * num_kv_heads * head_size * 2 * elem_size
                part_bytes = max(1, num_tokens) * num_heads * head_size * 4 * 2
                # A small grid (one request, a few KV heads) splits to about one resident wave of the
                # 32-key split tile (4 per SM); at 0.5-2 programs per SM the better target flipped with
                # the shape, so those keep split_target (H100 GQA/MHA b1-b32,
                # bench/results/attention-split-target-H100-2026-11-22.txt)
                target = max(1, split_target // 2) if 2 * programs <= self.num_sms else split_target
                splits = min(max_splits, -(-target * self.num_sms // programs), max_len // min_split)
                if part_cap:
                    splits = min(splits, kv_bytes // (part_cap * part_bytes))
                if merge_cap:  # S^2 * rows * 4 <= L * 2 * elem / merge_cap
                    rows = block_q * (num_heads // num_kv_heads)
                    splits = min(splits, math.isqrt(max_len * 2 * elem_size // (merge_cap * rows * 4)))
                splits = max(1, splits)
            seg_len = -(-max_len // splits)
            seg_len = -(-seg_len // block_n) * block_n
            splits = -(-max_len // seg_len)
            min_seg = -(-max(min_split, 1) // block_n) * block_n
            self.plans[key] = Plan(grid, splits, min_seg)
        return self.plans[key]

    def launch(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
               fused: bool, kv_dtype: torch.dtype | None = None) -> tuple[TileConfig, Plan]:
        """Tiles and plan for one layer shape, chosen once per step (every layer of a model has the
        same); keyed by ``HWKV_CUDA_ATTN_CONFIG`` as well, so a sweep may change it between calls.
        ``kv_dtype`` is the cache's (None: ``dtype``): an fp8 cache reads half the bytes per key."""
        kv_dtype = kv_dtype or dtype
        key = (num_heads, num_kv_heads, head_size, dtype, kv_dtype, fused, os.environ.get(OVERRIDE_ENV, ""),
               os.environ.get(FP8_OVERRIDE_ENV, ""), os.environ.get(DECODE_OVERRIDE_ENV, ""))
        if key not in self.launches:
            self.launches[key] = self._choose(num_heads, num_kv_heads, head_size, dtype, fused, kv_dtype.itemsize)
        return self.launches[key]

    def _choose(self, num_heads: int, hkv: int, d: int, dtype: torch.dtype, fused: bool,
                kv_elem: int) -> tuple[TileConfig, Plan]:
        c, elem, d_pad = self.common, dtype.itemsize, max(16, pow2(d))
        pick = lambda **kw: fit_shared_memory(
            choose_config(c.max_query_len, num_heads // hkv, d, dtype, kv_elem=kv_elem, **kw), d_pad, elem, self.smem,
            kv_elem)
        plan = lambda cfg: self.plan(cfg.block_q, cfg.block_n, num_heads, hkv, d, kv_elem, cfg.split_below,
                                     cfg.split_target, cfg.min_split, cfg.part_cap, cfg.merge_cap if fused else 0,
                                     cfg.max_splits)
        cfg = pick()
        short = c.max_query_len > 1 and self.mostly_short(cfg.block_q)
        if short:
            cfg = pick(short=True)
        # prefill tiles follow the programs with work (q blocks x KV heads), which depend only on BLOCK_Q
        wide = c.max_query_len > 1 and self.programs(cfg.block_q, hkv) >= 2 * self.num_sms
        if wide:
            cfg = pick(wide=True, short=short)
        p = plan(cfg)
        if p.splits > 1:
            split_cfg = pick(split=True, seg=-(-max(c.max_seq_len, 1) // p.splits), wide=wide, short=short)
            if split_cfg != cfg:
                cfg, p = split_cfg, plan(split_cfg)
        elif c.max_query_len == 1:  # a decode grid that fills the GPU unsplit (the plan's split rule uses no tile)
            full_cfg = pick(full=True)
            if full_cfg != cfg:
                cfg, p = full_cfg, plan(full_cfg)
        return cfg, p


class CudaMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: AttentionMetadata) -> CudaAttentionMetadata:
        return CudaAttentionMetadata(common, *device_limits(common.seq_lens.device))


class TritonAttentionImpl(AttentionImpl):
    """Triton paged attention over a PER_LAYER (or cross-layer view) ``[nb, 2, bs, H_kv, D]`` cache."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float):
        super().__init__(num_heads, head_size, num_kv_heads, scale)
        self.counters = SplitCounters()  # per impl: two impls may run on different streams
        self._sinks: tuple[torch.Tensor, torch.Tensor] | None = None  # (model's sinks, float32 copy on device)

    def _features(self, device: torch.device) -> dict[str, Any]:
        """Kernel arguments of the layer's window / soft-cap / sinks (constexpr flags: a layer without
        them compiles the plain kernel). Sinks move to ``device`` once, as float32."""
        kw: dict[str, Any] = {}
        if self.window is not None:
            if self.window < 1:
                raise ValueError(f"window must be >= 1, got {self.window}")
            kw.update(window=int(self.window), WINDOW=True)
        if self.softcap is not None:
            if not self.softcap > 0:
                raise ValueError(f"softcap must be > 0, got {self.softcap}")
            kw.update(cap2=float(self.softcap) * LOG2E, SOFTCAP=True)
        if self.sinks is not None:
            if self.sinks.shape != (self.num_heads,):
                raise ValueError(f"sinks must be [{self.num_heads}] (one per query head), "
                                 f"got {tuple(self.sinks.shape)}")
            src = self.sinks
            if self._sinks is None or self._sinks[0] is not src or self._sinks[1].device != device:
                # the loader fills the model's sinks in place after make_impl: convert on first use
                self._sinks = (src, src.detach().to(device=device, dtype=torch.float32).contiguous())
            kw.update(sinks_ptr=self._sinks[1], SINKS=True)
        return kw

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        """Scatter ``key``/``value`` into the cache at ``slot_mapping``. A slot must be ``-1`` (skip) or
        in ``[0, num_blocks * block_size)``; the kernel never writes outside the cache: any other slot
        is skipped like ``-1`` without a sync. ``HWKV_CUDA_CHECK_SLOTS=1`` checks on the host first and
        raises ``ValueError`` naming the slot, like the reference (a device sync, so off by default,
        and skipped while a CUDA graph is being captured)."""
        from hwkv_cuda.kernels.cache import write_kv_kernel

        _check_kv(layer_kv, self.num_kv_heads, self.head_size)
        n = slot_mapping.numel()
        if key.shape[0] < n or value.shape[0] < n:  # rows past n are ignored (the interface contract)
            raise ValueError(f"key/value have {key.shape[0]}/{value.shape[0]} tokens but slot_mapping has {n}: "
                             "one row per slot is needed (rows past the last slot are ignored)")
        if n == 0:
            return
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            key, value = key.contiguous(), value.contiguous()
        nb, _, bs, hkv, d = layer_kv.shape
        if os.environ.get(CHECK_SLOTS_ENV, "") == "1" and not _capturing(slot_mapping.device):
            check_slots(slot_mapping, nb, bs)
        fp8 = is_quantized(layer_kv.dtype)
        scales = self.scales_for(layer_kv) if fp8 else slot_mapping  # unused unless fp8
        write_kv_kernel[(n,)](
            key, value, layer_kv, slot_mapping, nb * bs,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(2), layer_kv.stride(3),
            H_KV=hkv, HEAD_SIZE=d, H_PAD=pow2(hkv), D_PAD=max(16, pow2(d)), BS=bs,
            scale_ptr=scales, stride_scale=scales.stride(0) if fp8 else 0, KV_FP8=fp8,
            **({"PDL": True, "launch_pdl": True} if os.environ.get(ELEMENTWISE_PDL_ENV, "0") == "1"
               and key.device.type == "cuda" and use_pdl(key.device) else {}),
        )

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any,
                metadata: Any) -> torch.Tensor:
        out = torch.empty_like(query)
        self.forward_into(out, query, layer_kv, metadata)
        return out

    def forward_into(self, out: torch.Tensor, query: torch.Tensor, layer_kv: torch.Tensor, metadata: Any) -> None:
        from hwkv_cuda.kernels.attention import attention_kernel, decode_heads_kernel, reduce_kernel

        md = metadata if isinstance(metadata, CudaAttentionMetadata) else CudaMetadataBuilder().build(metadata)
        c = md.common
        _check_kv(layer_kv, self.num_kv_heads, self.head_size)
        if query.dim() != 3 or query.shape[1:] != (self.num_heads, self.head_size) or query.stride(-1) != 1:
            raise ValueError(f"query must be [tokens, {self.num_heads}, {self.head_size}] with unit last stride, "
                             f"got {tuple(query.shape)}")
        if c.num_reqs == 0 or query.shape[0] == 0:
            return
        nb, _, bs, hkv, d = layer_kv.shape
        if bs != c.block_size:
            raise ValueError(f"KV block size {bs} differs from metadata block_size {c.block_size}")
        if fp8g.enabled() and is_quantized(layer_kv.dtype) and fp8g.applies(self, query, layer_kv, md):
            fp8g.forward_fp8g(self, out, query, layer_kv, md)  # the Gluon fp8 decode (HWKV_CUDA_FP8G=0: off)
            return
        group = self.num_heads // hkv
        d_pad = max(16, pow2(d))
        fused = reduce_mode() == "fused"
        cfg, (grid_q, splits, min_seg) = md.launch(self.num_heads, hkv, d, query.dtype, fused, layer_kv.dtype)
        features = self._features(query.device)
        all_heads = bool(cfg.all_heads) and cfg.block_q == 1 and md.one_token and not features
        if cfg.all_heads and not all_heads:  # a window, soft-cap or sinks: the tile the all-heads kernel replaces
            cfg = replace(cfg, all_heads=0, **ALL_HEADS_FALLBACK)
        fused = fused and splits > 1
        splits_pad = pow2(splits)
        g_pad = pow2(group)
        # constant when unused, so the unfused variants do not compile once per merge tile
        merge_rows, merge_splits = (merge_tile(cfg.block_q, g_pad, splits_pad, d_pad, cfg.num_warps, cfg.merge_regs)
                                    if fused else (1, 1))
        if splits > 1:
            part_acc = torch.empty((query.shape[0], self.num_heads, splits_pad, d_pad), dtype=torch.float32,
                                   device=query.device)
            part_ml = torch.empty((query.shape[0], self.num_heads, splits_pad, 2), dtype=torch.float32,
                                  device=query.device)
        else:
            part_acc = part_ml = out  # unused
        counters = self.counters.get(query.device, grid_q * hkv) if fused else out  # unused unless fused
        pdl = use_pdl(query.device)
        fp8 = is_quantized(layer_kv.dtype)
        scales = self.scales_for(layer_kv) if fp8 else out  # unused unless fp8
        # fp8_unpack: 1 reads int16 words of two codes (even head sizes), 2 casts K rows and transposes them,
        # 3 is 1 with fp16 dots for a bf16 query, 4 / 6 are 0 / 2 cast to fp16 with fp16 dots (TileConfig)
        prefetch = bool(cfg.prefetch) and cfg.block_q == 1
        words = cfg.fp8_unpack in (1, 3) and not prefetch
        unpack = cfg.fp8_unpack if fp8 and (not words or d % 2 == 0) else 0
        if fp8 and prefetch:
            unpack = 7  # its fp16 dots (the query in fp16 once per program); the loop casts rows itself
        kv = layer_kv.view(torch.int16) if fp8 and words and unpack else layer_kv  # two codes per word
        if fp8 and (layer_kv.stride(3) != d or layer_kv.stride(2) != hkv * d):
            raise ValueError("an fp8 cache's V pages are [H_kv, D, block_size] (hwkv.interfaces.kv_quant): its blocks "
                             f"must be contiguous, got strides {layer_kv.stride()}")
        one_tile = splits > 1 and -(-max(c.max_seq_len, 1) // splits) <= cfg.block_n  # every split one tile
        early = (one_tile if cfg.early < 0 else bool(cfg.early)) and cfg.block_q == 1 and md.one_token and not fp8 \
            and not prefetch
        head_major = bool(cfg.head_major) and grid_q <= 65535  # a grid's y and z sizes stop at 65,535
        if all_heads:  # every KV head of a request in one program (TileConfig.all_heads)
            decode_heads_kernel[(c.num_reqs, splits)](
                query, layer_kv, out, part_acc, part_ml, counters, c.seq_lens, c.block_tables, scales,
                min_seg, self.scale * LOG2E, scales.stride(0) if fp8 else 0,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(2), layer_kv.stride(3),
                c.block_tables.stride(0),
                HKV=hkv, H_PAD=pow2(hkv), G=group, GN=max(8, g_pad), HEAD_SIZE=d, D_PAD=d_pad, BS=bs,
                BLOCK_N=cfg.block_n, SPLIT=splits > 1, FUSED=fused, NUM_SPLITS_PAD=splits_pad, G_PAD=g_pad,
                MERGE_ROWS=merge_rows, MERGE_SPLITS=merge_splits, IEEE=query.dtype == torch.float32, PDL=pdl,
                KV_FP8=fp8, F16=fp8 and query.dtype == torch.bfloat16,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
                **({"launch_pdl": True} if pdl else {}),
            )
        else:
            attention_kernel[(hkv, grid_q, splits) if head_major else (grid_q, hkv, splits)](
                query, kv, out, part_acc, part_ml, counters,
                c.query_start_loc, c.seq_lens, c.block_tables, scales,
                c.num_reqs, min_seg, self.scale * LOG2E, scales.stride(0) if fp8 else 0,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), c.block_tables.stride(0),
                G=group, HEAD_SIZE=d, D_PAD=d_pad, BS=bs,
                BLOCK_M=cfg.block_m, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n,
                SPLIT=splits > 1, FUSED=fused, NUM_SPLITS_PAD=splits_pad, G_PAD=g_pad,
                MERGE_ROWS=merge_rows, MERGE_SPLITS=merge_splits, IEEE=query.dtype == torch.float32, PDL=pdl,
                KV_FP8=fp8, UNPACK=unpack, ONE_TOKEN=cfg.block_q == 1 and bool(cfg.direct) and md.one_token,
                HEAD_MAJOR=head_major, PREFETCH=prefetch, EARLY=early,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
                **({"launch_pdl": True} if pdl else {}),
                **features,
            )
        if splits > 1 and not fused:
            reduce_kernel[(query.shape[0], self.num_heads)](
                out, part_acc, part_ml, out.stride(0), out.stride(1), self.num_heads, splits,
                HEAD_SIZE=d, D_PAD=d_pad, NUM_SPLITS_PAD=splits_pad, num_warps=4,
            )


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ``ValueError`` naming the first slot outside ``[-1, num_blocks * block_size)`` (syncs)."""
    bad = (slot_mapping < -1) | (slot_mapping >= num_blocks * block_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot_mapping value {int(slot_mapping[i])} (token {i}) out of range "
                         f"[-1, {num_blocks * block_size}) for {num_blocks} blocks of {block_size}")


def _check_kv(layer_kv: Any, num_kv_heads: int, head_size: int) -> None:
    if not isinstance(layer_kv, torch.Tensor) or layer_kv.dim() != 5 or layer_kv.shape[1] != 2:
        raise ValueError("layer_kv must be a [num_blocks, 2, block_size, H_kv, D] tensor (PER_LAYER layout)")
    if layer_kv.shape[3:] != (num_kv_heads, head_size) or layer_kv.stride(-1) != 1:
        raise ValueError(f"layer_kv heads/head_size {tuple(layer_kv.shape[3:])} != ({num_kv_heads}, {head_size})")


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    kv_layout = KVLayoutKind.PER_LAYER

    def metadata_builder(self) -> CudaMetadataBuilder:
        return CudaMetadataBuilder()

    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> TritonAttentionImpl:
        if head_size < 1 or num_heads < 1 or num_kv_heads < 1:
            raise ValueError(f"num_heads {num_heads}, head_size {head_size}, num_kv_heads {num_kv_heads} must be >= 1")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
        return TritonAttentionImpl(num_heads, head_size, num_kv_heads, scale)

"""Triton :class:`DecodeOps`: every projection of a decode step as one fused GEMV launch
(:mod:`hwkv_cuda.kernels.dense`), chained by programmatic dependent launch on Hopper and newer.

``HWKV_CUDA_PDL=0`` launches without PDL (for A/B runs; :mod:`hwkv_cuda.launch`);
``HWKV_CUDA_DENSE_CONFIG`` (``"block_n=16,block_k=1024,num_warps=8"``) overrides the tile choice for
tuning sweeps, ``HWKV_CUDA_DENSE_CONFIG_<N>X<K>`` (e.g. ``_4096X2048``) for one ``[N, K]`` weight only.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.interfaces.kv_quant import is_quantized
from hwkv_cuda.allreduce import FUSED_SITES, FUSED_SLOT
from hwkv_cuda.launch import parse_overrides, use_pdl
from hwkv_cuda.tiles import pow2

CONFIG_ENV = "HWKV_CUDA_DENSE_CONFIG"
# the persistent GEMV's grid: "balanced" (default) takes the fewest programs that give each the same number of tiles
# (+-1) - gate_up's 2,048 tiles on 4 x 132 slots: 512 programs of 4 tiles, not 528 of which 64 take 3; "full": every
# slot (A/B: H200, public-defaults engine, replay 0.772 full vs 0.770 ms balanced, the same bits; bench/results/
# issue36-s9-b1-b2-H200-2026-11-29-96753bc.md)
STREAM_GRID_ENV = "HWKV_CUDA_STREAM_GRID"
ARGMAX_ENV = "HWKV_CUDA_ARGMAX"
ARGMAX_ROWS_ENV = "HWKV_CUDA_ARGMAX_ROWS"  # most rows the one-launch argmax takes (A/B; default ARGMAX_MAX_ROWS)
ARGMAX_BLOCK = 4096  # logits per program of the argmax (32 programs a row of 128,256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class DenseConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    preload: int = 0  # 1, 2: the first weight tile loaded before the PDL wait (kernels/dense.py)
    evict: int = 0  # 1: weight loads evict-first (A/B)
    split_k: int = 1  # > 1: programs per row block, each over 1/split_k of K, summed by the last (plain epilogues)
    maxnreg: int = 0  # > 0: registers a thread may use (ptxas spills the rest): more programs per SM - an 8-row
    # 2048-wide tile takes 168-206 registers at sm_90 (one 8-warp program per SM), 128 two
    stream: int = 0  # > 0: the persistent GEMV (kernels/dense.py, dense_kernel_stream) with this many programs per
    # SM, each looping over block_n-row tiles of the whole K (not with the tensor-parallel sum; M_PAD x K <=
    # STREAM_MAX_X), or of K in block_k chunks where block_k < K (M_PAD x block_k <= STREAM_MAX_X; no preload);
    # preload there: 1 the first tile before the PDL wait and each next one before the current one's dot, 2 the
    # first tile alone before the wait; num_stages > 1 asks Triton to pipeline the tile loop; split_k and maxnreg do
    # not apply
    l2pf: int = 0  # with stream, on sm_90+: 1 a bulk L2 prefetch of the first tile before the PDL wait (no registers
    # held), 2 as well of the next tile at the top of every iteration. A/B only: slower on every 1B shape (H200,
    # bench/results/issue36-s9-b1-b2b-H200-2026-11-29-a6d94db.md), as is a stream tile's K in chunks (block_k < K).
    # (Every tile of a program toward L2 before the wait, for qkv / o_proj of a tp=2 rank of Llama-3-8B, lost too:
    # +5.3 / +7.2 % a replay, bench/results/issue34-s10-tpb1-b2-H200-2026-11-29-e5d88f8.md; removed)


# One token, per weight shape [N, K]: the fastest tile of the H200 sweep (dense_probe --model llama-8b-tp2,llama-8b
# --quick, PDL chains in a graph; bench/results/tp-H200x2-2026-11-28-bf27901.md) at Llama-3-8B's projections, whole
# (tp=1) and a rank's shard at tp=2, where it beat the rule below by >= 3 %: 8-row programs for the K loop
# (12-18 % faster), 4 x 1024 preloaded for the o_proj shapes (7-12 %). In the engine they took the batch-1 step from
# 5.00 to 4.33 ms (tp=1) and 3.25 to 2.83 ms (tp=2). Other shapes keep the rule (its sweeps: H100, Llama-3.2-1B).
M1_TILES: dict[tuple[int, int], tuple[int, ...]] = {  # (N, K): block_n, block_k, warps, stages, preload[, evict, ...]
    (6144, 4096): (8, 2048, 8, 3, 0), (4096, 4096): (4, 1024, 4, 1, 1), (28672, 4096): (8, 2048, 8, 3, 0),
    (4096, 14336): (8, 2048, 8, 3, 0),  # Llama-3-8B: qkv, o_proj, gate_up, down
    (3072, 4096): (8, 2048, 8, 3, 0), (4096, 2048): (4, 1024, 4, 1, 1), (14336, 4096): (8, 2048, 8, 3, 0),
    (4096, 7168): (8, 2048, 8, 3, 0),  # its rank's shard at tp=2
    # Llama-3.2-1B: qkv and o_proj from the H200 sweep of batch 2 (dense_probe --model llama-1b --quick: 6.85 ->
    # 5.94 and 3.55 -> 3.41 µs; bench/results/issue36-batch2-H200-2026-11-28-479d2cf.md). gate_up and down keep the
    # rule: the 8-row pipelined tile of the 8B shapes, unswept at 1B, cost the batch-1 step 962 vs 999 tok/s in the
    # same-run A/B of call 1 (bench/results/issue36-call1-H200-2026-11-28-8b3214a.md)
    # (qkv's 1B tile of then: (8, 2048, 8, 3, 0); o_proj's: (4, 2048, 4, 1, 1); both replaced below)
    # gate_up, down and the LM head from this session's H200 sweep (dense_probe --model llama-1b --quick --evict;
    # bench/results/issue36-b1-batch1-H200-2026-11-29-e784792.md): down's first K tile before the PDL wait 12.26 ->
    # 10.35 µs, gate_up on 8 warps with evict-first weights 20.73 -> 19.64, the head 4 x 1024 preloaded 139.9 ->
    # 131.5; in the engine (same-run A/B, one H200, bench/results/issue36-b1-batch1b-H200-2026-11-29-312154c.md)
    # the batch-1 step went 0.997 -> 0.958 ms (1,003 -> 1,044 tok/s), the replay 0.940 -> 0.900 ms
    # gate_up since session 8's batch 1 (same-run engine A/B,
    # bench/results/issue36-b1-s8-batch1-H200-2026-11-29-e80f843.md): 8-row programs, 1,085 -> 1,117 tok/s (replay
    # 0.887 -> 0.861 ms), the same tokens - half the programs, each normalising the input row once (the 8-row tile
    # at sm_90: one program of 8 warps per SM, 168 registers a thread)
    # gate_up and the LM head since session 9 (greedy per-shape sweep in one public-defaults engine,
    # backends/cuda/scripts/b1_tile_sweep.py; bench/results/issue36-s9-b1-b1b-H200-2026-11-29-97cfb38.md): the
    # persistent GEMV (stream=N programs per SM; kernels/dense.py, dense_kernel_stream), each program forming the
    # normalised input row once and looping over tiles - gate_up 8 rows on 8 warps, 4 a SM, evict-first (replay 0.812
    # -> 0.797 ms alone), the LM head 4 rows on 4 warps, 6 a SM, its first tile before the PDL wait, evict-first
    # (0.812 -> 0.801 alone); both give main's greedy tokens. The tuple's fields: DenseConfig's
    (16384, 2048): (8, 2048, 8, 1, 0, 1, 1, 0, 4), (2048, 8192): (4, 2048, 8, 3, 2),
    (128256, 2048): (4, 2048, 4, 1, 2, 1, 1, 0, 6),
    # qkv since session 9 (the same sweep): 4 rows on 4 warps, first tile before the PDL wait, as many programs as
    # tiles (768; 6 a SM asked) - replay 0.7963 -> 0.7826 ms over the gate_up tile above, 0.812 -> 0.797 alone; the
    # three together 0.812 -> 0.772 ms, step 0.833 -> 0.793 ms. Another reduction order than the 8-warp tile: the
    # random-weight 1B model's greedy tokens part from main's at position 10 (no 8-warp stream tile beat main)
    (3072, 2048): (4, 2048, 4, 1, 2, 0, 1, 0, 6),
    # o_proj since session 9's batch 2 (the same sweep over the three above, balanced grid): 4 rows on 4 warps, 4 a
    # SM, first tile before the PDL wait, evict-first - replay 0.7681 -> 0.7629 ms, step 0.791 -> 0.787 ms, 1,264 ->
    # 1,270 tok/s, main's greedy tokens (bench/results/issue36-s9-b1-b2-H200-2026-11-29-96753bc.md)
    (2048, 2048): (4, 2048, 4, 1, 2, 1, 1, 0, 4),
}


def choose_config(m: int, n: int, k: int) -> DenseConfig:
    """Tiles by shape, from the H100 sweeps at M=1 (bench/results/dense-probe-*-H100-2026-11-22.json):
    a K tile of up to 2048, shrinking with the token count so the weight tile and the fp32 inputs
    stay in registers; see the branches for the rest. (A persistent variant streaming row tiles
    through a pipelined loop measured 5-20% slower on every shape and was dropped on the H100; since session 9 a
    persistent variant of light programs, several per SM, is the one-token tile of the 1B gate_up, qkv, o_proj and
    LM head: ``stream`` in ``M1_TILES``.)"""
    block_k = min(max(16, pow2(k)), 2048 // min(pow2(m), 4))
    if k > block_k:  # several K tiles (the down projection): a K loop on 4-row programs
        cfg = {"block_n": 4, "block_k": block_k, "num_warps": 8, "num_stages": 3, "preload": 0}
    elif n * k > 64 << 20:  # the LM head: many waves, so a pre-wait load helps only the first
        cfg = {"block_n": 8, "block_k": block_k, "num_warps": 8, "num_stages": 3, "preload": 0}
    else:  # one tile, loaded before the PDL wait
        cfg = {"block_n": 4 if n * k > 8 << 20 else 8, "block_k": block_k, "num_warps": 4, "num_stages": 1,
               "preload": 1}
    if m == 1 and (n, k) in M1_TILES:
        cfg = dict(zip(DenseConfig._fields, M1_TILES[(n, k)]))
    cfg.update(parse_overrides(CONFIG_ENV, DenseConfig._fields))
    cfg.update(parse_overrides(f"{CONFIG_ENV}_{n}X{k}", DenseConfig._fields))  # one weight shape only
    if cfg["block_n"] < 2 or cfg["block_n"] & (cfg["block_n"] - 1):
        raise ValueError(f"{CONFIG_ENV}: block_n must be a power of two >= 2, got {cfg['block_n']}")
    if cfg.get("split_k", 1) not in (1, 2, 4, 8):
        raise ValueError(f"{CONFIG_ENV}: split_k must be 1, 2, 4 or 8, got {cfg['split_k']}")
    if cfg.get("evict", 0) not in (0, 1):
        raise ValueError(f"{CONFIG_ENV}: evict must be 0 or 1, got {cfg['evict']}")
    if not 0 <= cfg.get("maxnreg", 0) <= 255:
        raise ValueError(f"{CONFIG_ENV}: maxnreg must be 0 (no cap) to 255, got {cfg['maxnreg']}")
    if cfg.get("l2pf", 0) not in (0, 1, 2):
        raise ValueError(f"{CONFIG_ENV}: l2pf must be 0, 1 or 2, got {cfg['l2pf']}")
    if cfg.get("stream", 0) < 0:
        raise ValueError(f"{CONFIG_ENV}: stream must be >= 0 (programs per SM of the persistent GEMV), got "
                         f"{cfg['stream']}")
    if cfg["preload"] not in (0, 1, 2):
        raise ValueError(f"{CONFIG_ENV}: preload must be 0 (a plain K loop), 1 (each next tile after the dot) or 2 "
                         f"(the first tile before the wait, then the loop), got {cfg['preload']}")
    return DenseConfig(**cfg)


class TritonDecodeOps(DecodeOps):
    # The model uses them for single-token forwards only: there they win (H100 batch-1 decode, MBU
    # 73% vs 61% with cuBLAS), while with up to 8 tokens the offline run lost 21% (26.8k vs 34.0k
    # tok/s, bench/results/e2e-throughput-ab-H100-2026-11-22.md; not profiled yet — the likely cost
    # is _rows_dot's row-by-row reduction, O(M^2 K) per tile). Up to 8 tokens they are correct
    # (conformance) but untuned.
    preferred_tokens = 1
    ARGMAX_MAX_ROWS = 256  # rows the one-launch argmax takes (argmax; measured up to the offline batch of 256)
    SPLIT_COUNTERS = 1 << 16  # row blocks a split-K launch may have (one arrival counter each, per device)
    STREAM_MAX_X = 8192  # input values (M_PAD x pow2(K)) the persistent GEMV holds in registers

    def __init__(self) -> None:
        self._split_cnt: dict[torch.device, torch.Tensor] = {}  # zeroed once; each launch leaves them zero
        self._argmax_bufs: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # argmax: (slots, counters)
        self._argmax_kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _split_k(self, cfg: DenseConfig, x: torch.Tensor, n: int, k: int, epilogue: int, rs: Any) -> int:
        """``cfg.split_k`` where it applies, else 1: plain epilogues (no RoPE/KV write, no all-reduce), K in whole
        tiles per split, no next-tile preload, few enough row blocks, and its counters allocated outside a graph
        capture (the first eager call allocates them)."""
        sk = cfg.split_k
        if sk == 1 or epilogue not in (0, 1) or rs is not None or cfg.preload == 1 or k % (sk * cfg.block_k) \
                or -(-n // cfg.block_n) > self.SPLIT_COUNTERS:
            return 1
        if x.device not in self._split_cnt:
            if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return 1
            self._split_cnt[x.device] = torch.zeros(self.SPLIT_COUNTERS, dtype=torch.int32, device=x.device)
        return sk

    def _stream(self, cfg: DenseConfig, m: int, k: int, epilogue: int, push: Any, rs: Any) -> bool:
        """Whether ``cfg.stream`` applies: no tensor-parallel sum in the kernel, the input rows' K in registers."""
        return bool(cfg.stream) and epilogue in (0, 1, 2) and push is None and rs is None \
            and pow2(m) * min(pow2(k), pow2(cfg.block_k)) <= self.STREAM_MAX_X

    def validate(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype) -> list[str]:
        reasons = []
        if dtype not in DTYPES:
            reasons.append(f"dtype {dtype} (allowed: {', '.join(map(str, DTYPES))})")
        if head_dim % 2:
            reasons.append(f"head_dim {head_dim} is odd (RoPE pairs i with i + head_dim/2)")
        if kv_dtype != dtype and not is_quantized(kv_dtype):
            reasons.append(f"KV cache dtype {kv_dtype} differs from the activations' {dtype} (the KV write "
                           "casts without a scale; allowed: the same dtype, or fp8 e4m3 with scales)")
        return reasons

    def rank_sum(self, comm: Any) -> TritonRankSum | None:
        ar = getattr(comm, "custom_all_reduce", None)
        return TritonRankSum(self, ar) if getattr(ar, "fused", False) and getattr(ar, "fbuf", None) is not None \
            else None

    def _launch(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_per_k: int,
                prologue: int, epilogue: int, *, residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 0.0, rope: tuple[Any, ...] | None = None,
                push: tuple[Any, int] | None = None, rs: tuple[Any, Pending, torch.Tensor] | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from hwkv_cuda.kernels.dense import dense_kernel

        if weight.dim() != 2 or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [N, K] matrix, got shape {tuple(weight.shape)} "
                             f"strides {weight.stride()}")
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != in_per_k * k or x.stride(-1) != 1:
            raise ValueError(f"input must be [tokens, {in_per_k * k}] with unit last stride, got {tuple(x.shape)}")
        m = x.shape[0]
        if m > self.max_tokens:
            raise ValueError(f"{m} tokens; these ops take at most {self.max_tokens}")
        for name, t, want in (("bias", bias, (n,)), ("norm weight", norm_weight, (k,))):
            if t is not None and tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want} for a [{n}, {k}] weight, got {tuple(t.shape)}")
        for name, t in (("bias", bias), ("norm weight", norm_weight)) + (
                (("cos", rope[0]), ("sin", rope[1]), ("positions", rope[2]), ("slot_mapping", rope[4]))
                if rope is not None else ()):
            if t is not None and t.stride(-1) != 1:
                raise ValueError(f"{name} must have a unit last stride, got strides {t.stride()}")
        # out_dtype (float32 logits): values rounded to the activation dtype, then stored widened
        y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
        ar_args: dict[str, Any] = {}
        h_out = None
        if push is not None:  # EPILOGUE 3: this partial into every peer's slot of the site
            ar, site = push
            if m * n * x.element_size() > FUSED_SLOT:
                raise ValueError(f"a [{m}, {n}] {x.dtype} output does not fit the fused all-reduce's slot of "
                                 f"{FUSED_SLOT} bytes (HWKV_TP_FUSED_AR=0 runs the push kernel instead)")
            ar_args = dict(peers_ptr=ar.fpeers, cnt_ptr=ar.fcnt, site=site, RANK=ar.rank, WS=ar.world_size,
                           SLOT=FUSED_SLOT // x.element_size(), CNT_OFF=ar.fcnt_off)
        if rs is not None:  # the input is residual + sum over ranks of the pending partial
            ar, pend, res = rs
            if res.shape != x.shape or res.dtype != x.dtype or not res.is_contiguous():
                raise ValueError(f"residual must be a contiguous {tuple(x.shape)} {x.dtype} tensor")
            h_out = torch.empty_like(res)
            ar_args = dict(buf_ptr=ar.fbuf.view(x.dtype), cnt_ptr=ar.fcnt, err_ptr=ar.error, hres_ptr=res,
                           hout_ptr=h_out, stride_hm=res.stride(0), site=pend.site,
                           expect=ar.world_size - 1, RANK=ar.rank, RS=ar.world_size,
                           SLOT=FUSED_SLOT // x.element_size())
        if m == 0:
            if push is not None:
                return Pending(y, push[1], 0)
            return y if h_out is None else (y, h_out)
        pdl = use_pdl(x.device)
        cfg = choose_config(m, n, k)
        res = residual if residual is not None else y
        stream = self._stream(cfg, m, k, epilogue, push, rs)
        sk = 1 if stream else self._split_k(cfg, x, n, k, epilogue, rs)
        if sk > 1:  # float32 partials [split, M_PAD, N] (the graph pool's memory inside a capture)
            ar_args.update(SPLIT_K=sk, part_ptr=torch.empty((sk, pow2(m), n), dtype=torch.float32, device=x.device),
                           sk_cnt_ptr=self._split_cnt[x.device])
        if rope is not None:
            cos, sin, pos, layer_kv, slots, heads, kv_heads, d, scales = rope
            nb, _, bs = layer_kv.shape[:3]
            kv_args = (cos, sin, pos, layer_kv, slots)
            strides = (layer_kv.stride(0), layer_kv.stride(1), layer_kv.stride(2), layer_kv.stride(3))
            geo = dict(HEAD=d, Q_N=heads * d, KV_N=kv_heads * d, BS=bs)
            if scales is not None:
                geo.update(scale_ptr=scales, stride_scale=scales.stride(0), KV_FP8=True)
            num_slots, stride_cos = nb * bs, cos.stride(0)
        else:
            kv_args, strides = (y, y, y, y, y), (0, 0, 0, 0)
            geo, num_slots, stride_cos = dict(HEAD=2, Q_N=0, KV_N=0, BS=1), 0, 0
        if stream:
            from hwkv_cuda.kernels.dense import dense_kernel_stream
            from hwkv_cuda.launch import device_limits

            tiles = -(-n // cfg.block_n)
            grid = min(tiles, device_limits(x.device)[0] * cfg.stream)
            if os.environ.get(STREAM_GRID_ENV, "balanced") != "full":  # as few programs as take the same tiles each
                grid = -(-tiles // -(-tiles // grid))
            dense_kernel_stream[(grid,)](
                x, weight, bias if bias is not None else y, y, res, norm_weight if norm_weight is not None else y,
                *kv_args, m, n, k, eps, num_slots, x.stride(0), y.stride(0), res.stride(0), stride_cos, *strides,
                PROLOGUE=prologue, EPILOGUE=epilogue, HAS_BIAS=bias is not None, M_PAD=pow2(m), BLOCK_N=cfg.block_n,
                BLOCK_K=min(pow2(k), pow2(cfg.block_k)), CHUNKED=cfg.block_k < k, PDL=pdl,
                PRE=0 if cfg.block_k < k else cfg.preload, EVICT=cfg.evict, **geo,
                STAGES=cfg.num_stages, L2PF=cfg.l2pf if x.device.type == "cuda" and pdl else 0,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **({"launch_pdl": True} if pdl else {}))
            return y
        dense_kernel[(-(-n // cfg.block_n) * sk,)](
            x, weight, bias if bias is not None else y, y, res, norm_weight if norm_weight is not None else y,
            *kv_args, m, n, k, eps, num_slots, x.stride(0), y.stride(0), res.stride(0), stride_cos, *strides,
            PROLOGUE=prologue, EPILOGUE=epilogue, HAS_BIAS=bias is not None, M_PAD=pow2(m),
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl, PRELOAD=cfg.preload, ONE_TILE=cfg.block_k >= k,
            EVICT=cfg.evict,
            **geo, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg and x.device.type == "cuda" else {}),
            **ar_args,
        )
        if push is not None:
            return Pending(y, push[1], -(-n // cfg.block_n))
        return y if h_out is None else (y, h_out)

    def qkv(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
            bias: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            impl: Any, layer_kv: Any, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
            head_dim: int, rs: tuple[Any, Pending, torch.Tensor] | None = None) -> Any:
        from hwkv_cuda.attention import _check_kv

        _check_kv(layer_kv, num_kv_heads, head_dim)
        n = (num_heads + 2 * num_kv_heads) * head_dim
        if weight.shape[0] != n:
            raise ValueError(f"qkv weight has {weight.shape[0]} rows, expected (H + 2 H_kv) * D = {n}")
        if positions.shape[0] != h.shape[0] or slot_mapping.shape[0] != h.shape[0]:
            raise ValueError(f"{h.shape[0]} tokens but {positions.shape[0]} positions and "
                             f"{slot_mapping.shape[0]} slots")
        scales = impl.scales_for(layer_kv) if is_quantized(layer_kv.dtype) else None
        rope = (cos, sin, positions, layer_kv, slot_mapping, num_heads, num_kv_heads, head_dim, scales)
        return self._launch(h, weight, bias, 1, 1, 2, norm_weight=norm_weight, eps=eps, rope=rope, rs=rs)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
        _same_rows(residual, x, weight.shape[0])
        return self._launch(x, weight, bias, 1, 0, 1, residual=residual)

    def norm_linear(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
        return self._launch(h, weight, bias, 1, 1, 0, norm_weight=norm_weight, eps=eps)

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor) -> torch.Tensor:
        _same_rows(residual, gate_up, weight.shape[0])
        return self._launch(gate_up, weight, bias, 2, 2, 1, residual=residual)

    def norm_logits(self, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
        return self._launch(h, weight, None, 1, 1, 0, norm_weight=norm_weight, eps=eps, out_dtype=torch.float32)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor | None:
        """One launch (:mod:`hwkv_cuda.kernels.sampling`) instead of the sampler's five, for up to
        ``ARGMAX_MAX_ROWS`` rows (larger batches keep the sampler's path: not measured; ``HWKV_CUDA_ARGMAX_ROWS``
        sets the bound for A/B runs); ``HWKV_CUDA_ARGMAX=0``: not offered (A/B). H200, the 1B shape's batch-1 decode
        in one engine: step 0.842 -> 0.831 ms, the same tokens (bench/results/issue36-b1-s8-batch2b-H200-2026-11-29-
        cbd2ac3.md). Up to 256 rows since session 9: the 1B offline workload (256 x 512 / 256) in one engine, 1.268 /
        1.277 s with 64 rows against 1.235 s with 256 (a batch-256 decode step 3.05-3.09 -> 2.98 ms on the device),
        the same tokens (bench/results/issue36-s9-perf-b1-H200-2026-11-29-869ec68.md). Its per-row slots and counters
        are allocated outside a graph capture (None inside one until an eager call has made them), set once and left so
        by every launch."""
        from hwkv_cuda.kernels.sampling import EMPTY, argmax_kernel

        if os.environ.get(ARGMAX_ENV, "1") == "0" or logits.dim() != 2 or logits.dtype != torch.float32 \
                or logits.stride(-1) != 1 or logits.shape[1] >= 1 << 31 \
                or logits.shape[0] > int(os.environ.get(ARGMAX_ROWS_ENV, self.ARGMAX_MAX_ROWS)):
            return None
        r, v = logits.shape
        out = torch.empty(r, dtype=torch.int64, device=logits.device)
        if r == 0 or v == 0:
            return None if v == 0 else out
        bufs = self._argmax_bufs.get(logits.device)
        if bufs is None or bufs[0].numel() < r:
            if logits.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            n = max(1024, pow2(r))
            bufs = (torch.full((n,), EMPTY.value, dtype=torch.int64, device=logits.device),
                    torch.zeros(n, dtype=torch.int32, device=logits.device))
            self._argmax_bufs[logits.device] = bufs  # a graph captured with the old ones keeps them alive
            self._argmax_kept.append(bufs)
        argmax_kernel[(r, -(-v // ARGMAX_BLOCK))](logits, *bufs, out, v, logits.stride(0), BLOCK=ARGMAX_BLOCK,
                                                 num_warps=4)
        return out


class Pending(NamedTuple):
    """A row-parallel projection's output on this rank, pushed to every peer's slot of ``site`` by its
    ``programs`` programs: summed over the ranks by the op that takes it (:class:`TritonRankSum`)."""

    partial: torch.Tensor
    site: int
    programs: int


class TritonRankSum:
    """:meth:`DecodeOps.rank_sum` on CUDA: the row-parallel all-reduce inside the decode GEMVs
    (:mod:`hwkv_cuda.kernels.dense`, ``EPILOGUE=3`` and ``RS``) over the custom all-reduce's peer buffers
    (``HWKV_TP_FUSED_AR=1``), instead of a push kernel and its barrier between them. Sites alternate
    per call (every forward makes an even number: two per layer), as the push kernel's parities."""

    def __init__(self, ops: TritonDecodeOps, ar: Any):
        self.ops, self.ar, self._calls = ops, ar, 0

    def _site(self) -> int:
        site, self._calls = self._calls % FUSED_SITES, self._calls + 1
        return site

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Pending:
        return self.ops._launch(x, weight, bias, 1, 0, 3, push=(self.ar, self._site()))

    def silu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Pending:
        return self.ops._launch(gate_up, weight, bias, 2, 2, 3, push=(self.ar, self._site()))

    def qkv(self, s: Pending, h: torch.Tensor, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.qkv(s.partial, *args, rs=(self.ar, s, h))

    def norm_linear(self, s: Pending, h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops._launch(s.partial, weight, bias, 1, 1, 0, norm_weight=norm_weight, eps=eps,
                                rs=(self.ar, s, h))

    def sum(self, s: Pending, h: torch.Tensor) -> torch.Tensor:
        from hwkv_cuda.kernels.dense import rank_sum_kernel

        x, ar = s.partial, self.ar
        if h.shape != x.shape or h.dtype != x.dtype or not h.is_contiguous():
            raise ValueError(f"residual must be a contiguous {tuple(x.shape)} {x.dtype} tensor")
        out = torch.empty_like(h)
        if x.numel() == 0:
            return out
        pdl = use_pdl(x.device)
        block = 1024
        rank_sum_kernel[(max(1, -(-x.numel() // block)),)](
            x, ar.fbuf.view(x.dtype), h, out, ar.fcnt, ar.error, x.numel(), x.shape[1], s.site,
            ar.world_size - 1, RANK=ar.rank, RS=ar.world_size, SLOT=FUSED_SLOT // x.element_size(),
            BLOCK=block, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
        return out


def _same_rows(residual: torch.Tensor, x: torch.Tensor, n: int) -> None:
    if residual.shape != (x.shape[0], n) or residual.stride(-1) != 1:
        raise ValueError(f"residual must be [{x.shape[0]}, {n}] with unit last stride, got {tuple(residual.shape)}")

"""``y = x @ w.T (+ b)`` for forwards of many tokens whose output tiles leave SMs idle: split-K on tensor cores.

At a decode batch of 64-256 tokens the narrow projections (o_proj and down: ``N = hidden``) have fewer 128 x 128
output tiles than the GPU has SMs (the 1B shape at 256 tokens: 2 x 16 = 32 tiles on 132 SMs), and cuBLAS's choice for
them ran at 310-410 TFLOP/s on the H200 against ~700 for the wide gate_up (bench/results/issue36-batch2-H200-2026-11-
28-479d2cf.md). Here each output tile is computed by ``SPLIT_K`` programs, each over ``K / SPLIT_K``; every program
writes its float32 partial to a workspace ``[SPLIT_K, M, N]``, and the tile's last program to arrive (an acq_rel
counter per tile, reset by it) sums the partials in split order - the same bits whichever program is last, so a step's
tokens do not depend on the scheduling. The counters are zero before and after every launch (graph replays reuse them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemm_kernel(x_ptr, w_ptr, y_ptr, b_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr):
    pid = tl.program_id(0)  # output tile; row blocks vary fastest: the programs of one weight column block run
    sk = tl.program_id(1)   # together, so its second read (the next row block) comes from L2
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    ok_m = offs_m < M
    ok_n = offs_n < N
    k_len = K // SPLIT_K  # a multiple of BLOCK_K (the host checks)
    k_lo = sk * k_len
    xp = x_ptr + offs_m[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    wp = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, k_len, BLOCK_K):
        a = tl.load(xp, mask=ok_m[:, None], other=0.0)
        b = tl.load(wp, mask=ok_n[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        xp += BLOCK_K
        wp += BLOCK_K
    out_ok = ok_m[:, None] & ok_n[None, :]
    if SPLIT_K > 1:
        tile = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(tile + sk * M * N, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial stored before the arrival
        done = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        last = (offs_m[:, None] * 0 + done) == SPLIT_K - 1
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(tile + s * M * N, mask=out_ok & last, other=0.0, cache_modifier=".cg")
        if done == SPLIT_K - 1:
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
        out_ok = out_ok & last
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=ok_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_ok)

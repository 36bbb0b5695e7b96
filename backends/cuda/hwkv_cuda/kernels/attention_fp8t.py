"""Transposed split-KV decode attention over an fp8 (e4m3) KV cache (Triton; issue #36, an A/B route).

One program owns one request's single query token times the ``G`` query heads of one KV head, over one split of
its keys, and runs the attention transposed: the keys sit in the MMA's M dimension.

* ``S^T = K . Q^T``: A is the K tile ``[BLOCK_N keys, D]`` of the token-major K pages, loaded as e4m3 and cast to
  fp16 in registers; B is ``Q^T`` ``[D, N_PAD]``, the GQA group padded to the MMA's smallest N (16).
* the online softmax runs along M: a running max and sum per column (query head) over the keys.
* ``O^T = V^T . P^T``: A is the ``[D, BLOCK_N]`` tile straight from the transposed V pages (``[H_kv, D, block_size]``
  per block, hwkv.interfaces.kv_quant: already K-major for this product), cast to fp16 in registers; B is ``P^T``.

At 4 warps (one warpgroup) a ``tl.dot`` whose A is a register tensor lowers on sm_90 to wgmma with A from registers
(cp.async -> ld.shared in the dot-operand layout -> cvt.rn.f16x2.e4m3x2 -> wgmma: the dequantised K and V never
cross shared memory), but the softmax down M then reduces across the 4 warps every tile (shared memory and a
barrier); measured slower than one warp (docs/fp8-kv-cache.md, session 10), where the dots are mma.sync and the
softmax stays in the warp: the default (:mod:`hwkv_cuda.attention_fp8t`). The dots run in
fp16: the query, scaled by 2^-8 into fp16 once per program (bf16 queries up to 2^24 fit), and the scale folded into
``qk_scale``; every e4m3 code is exact in fp16. Partials and the fused last-split merge are the unified kernel's
(:mod:`hwkv_cuda.kernels.attention`), so the reduction is bit for bit the same code.
"""

import triton
import triton.language as tl

from hwkv_cuda.kernels.attention import _merge
from hwkv_cuda.kernels.dense import gdc_launch_dependents, gdc_wait


@triton.jit
def _offsets(blk, pos, k_base, v_base, stride_blk, stride_tok, BS: tl.constexpr):
    """Each key's row of D codes in its K page and its code at dim 0 of its head's V^T page (dim ``d`` is ``d * BS``
    further). Tiles start at multiples of BLOCK_N (whole tiles per split): the keys' V codes run in groups of BS
    consecutive bytes."""
    koff = blk * stride_blk + k_base + (pos % BS) * stride_tok
    voff = blk * stride_blk + v_base + pos % BS
    VC: tl.constexpr = BS if BS % 16 == 0 else 1
    if VC > 1:
        voff = tl.max_contiguous(tl.multiple_of(voff, VC), VC)
    return koff, voff


@triton.jit
def _math_t(acc, l_i, m_i, qt, qk_scale, k, vt, n_mask, MASKED: tl.constexpr, LACC: tl.constexpr):
    """One tile: ``S^T = K . Q^T``, the online softmax down the keys, ``O^T += V^T . P^T``. ``LACC``: ``l_i`` is a
    ``[keys, N_PAD]`` running sum (reduced over the keys once, after the loop), not a cross-warp sum per tile."""
    st = tl.dot(k.to(tl.float16), qt) * qk_scale  # [keys, N_PAD] fp32
    if MASKED:
        st = tl.where(n_mask[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(st - m_safe[None, :])
    alpha = tl.math.exp2(m_i - m_safe)
    if LACC:
        l_i = l_i * alpha[None, :] + p
    else:
        l_i = l_i * alpha + tl.sum(p, 0)
    acc = acc * alpha[None, :] + tl.dot(vt.to(tl.float16), p.to(tl.float16))  # [D, N_PAD]
    return acc, l_i, m_new


@triton.jit
def _tile_t(acc, l_i, m_i, qt, qk_scale, kv_ptr, bt_ptr, start, hi, k_base, v_base, stride_blk, stride_tok,
            offs_n, offs_d, BS: tl.constexpr, MASKED: tl.constexpr, LACC: tl.constexpr):
    pos = start + offs_n
    n_mask = pos < hi
    if MASKED:
        blk = tl.load(bt_ptr + pos // BS, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + pos // BS).to(tl.int64)
    koff, voff = _offsets(blk, pos, k_base, v_base, stride_blk, stride_tok, BS)
    if MASKED:
        k = tl.load(kv_ptr + koff[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        vt = tl.load(kv_ptr + voff[None, :] + offs_d[:, None] * BS, mask=n_mask[None, :], other=0.0)
    else:
        k = tl.load(kv_ptr + koff[:, None] + offs_d[None, :])
        vt = tl.load(kv_ptr + voff[None, :] + offs_d[:, None] * BS)
    return _math_t(acc, l_i, m_i, qt, qk_scale, k, vt, n_mask, MASKED, LACC)


@triton.jit
def fp8t_decode_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    qk_scale, stride_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_blk, stride_kv, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, HEAD_SIZE: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, N_PAD: tl.constexpr,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, G_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr, PDL: tl.constexpr = False,
    LACC: tl.constexpr = False,
):
    """Grid ``(H_kv, requests, splits)``: a request's KV heads side by side. Every request has one query token
    (token ``i`` is request ``i``), sees all of its ``seq_len`` keys, and split ``s`` covers
    ``[s * seg, (s + 1) * seg)`` with ``seg`` from its own length in whole ``BLOCK_N`` tiles (a graph captured at an
    upper bound still spreads a short request over the splits). ``HEAD_SIZE`` is a power of two >= 16."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    n_kvh = tl.num_programs(0)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, N_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    head = kvh * G + offs_g
    tok = seq.to(tl.int64)
    q = tl.load(q_ptr + tok * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=g_ok[:, None], other=0.0)
    # 2^-8 times the query in fp16 (module doc); the K scale and the 256 go into qk_scale, V's into the output
    qt = tl.trans((q.to(tl.float32) * 0.00390625).to(tl.float16))  # [D, N_PAD]
    qk_scale = qk_scale * tl.load(kv_scale_ptr + kvh) * 256.0
    v_scale = tl.load(kv_scale_ptr + stride_scale + kvh)

    if SPLIT:
        seg = (seq_len + tl.num_programs(2) - 1) // tl.num_programs(2)
        seg = (seg + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    else:
        seg = seq_len
    lo = split * seg
    hi = tl.minimum(lo + seg, seq_len)
    n_full = tl.maximum(hi - lo, 0) // BLOCK_N
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = kvh.to(tl.int64) * stride_head
    v_base = stride_kv + kvh.to(tl.int64) * stride_head * BS

    m_i = tl.full([N_PAD], float("-inf"), tl.float32)
    if LACC:
        l_i = tl.zeros([BLOCK_N, N_PAD], tl.float32)
    else:
        l_i = tl.zeros([N_PAD], tl.float32)
    acc = tl.zeros([HEAD_SIZE, N_PAD], tl.float32)
    for i in range(n_full):
        acc, l_i, m_i = _tile_t(acc, l_i, m_i, qt, qk_scale, kv_ptr, bt_ptr, lo + i * BLOCK_N, hi, k_base,
                                v_base, stride_blk, stride_tok, offs_n, offs_d, BS, False, LACC)
    for start in range(lo + n_full * BLOCK_N, hi, BLOCK_N):  # the request's last, partial tile
        acc, l_i, m_i = _tile_t(acc, l_i, m_i, qt, qk_scale, kv_ptr, bt_ptr, start, hi, k_base, v_base,
                                stride_blk, stride_tok, offs_n, offs_d, BS, True, LACC)
    if LACC:
        l_i = tl.sum(l_i, 0)
    acc = acc * v_scale

    if SPLIT:
        # the unified kernel's partials [tokens, heads, NUM_SPLITS_PAD, (D | 2)]; empty splits write (-inf, 0)
        row = (tok * (G * n_kvh) + head) * NUM_SPLITS_PAD + split
        tl.store(part_acc_ptr + row[None, :] * HEAD_SIZE + offs_d[:, None], acc, mask=g_ok[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)
        if FUSED:  # the last split to arrive merges (ordering: see the counter in kernels/attention.py)
            tl.debug_barrier()
            cnt = counter_ptr + seq * n_kvh + kvh
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:
                tl.debug_barrier()
                _merge(out_ptr, part_acc_ptr, part_ml_ptr, tok, 1, 0, kvh, G * n_kvh, tl.num_programs(2),
                       stride_ot, stride_oh, G, G_PAD, HEAD_SIZE, HEAD_SIZE, 1, NUM_SPLITS_PAD, MERGE_ROWS,
                       MERGE_SPLITS, False)
                tl.store(cnt, 0)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[None, :]
        tl.store(out_ptr + tok * stride_ot + head[None, :] * stride_oh + offs_d[:, None],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[None, :])

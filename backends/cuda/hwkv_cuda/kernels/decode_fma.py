"""Decode attention without tensor cores (opt-in ``fma=1`` tile field, one query token per request).

The MMA kernel (:mod:`hwkv_cuda.kernels.attention`) pads a GQA group of ``G`` query heads to 16 tile rows
and, over an fp8 cache, casts V in its loaded rows and stores the 16-bit tile to shared memory again for
``ldmatrix.trans`` (V's contiguous dim is the output's, so the MMA needs it transposed; there is no 8-bit
transposing load on sm_90). Here a program computes its ``G`` rows with fp32 FMAs: scores
``s[g, n] = sum_d q[g, d] k[n, d]`` and ``acc[g, d] += sum_n p[g, n] v[n, d]`` as broadcast products over
``[G_PAD, BLOCK_N, D_PAD]`` - no padding to 16 rows, no operand layout for an MMA, the cast in registers.
The query is scaled once per program (``qk_scale`` times the head's K scale), V's scale once at the end.
Every key below the request's length is visible (the query is its last token), so there is no causal mask.
``MODE`` (the ``fma`` tile field) picks the tiles' orientation, which decides the layouts Triton gives the
products and so which reductions stay inside a thread: 1 K and V as ``[keys, D]`` rows, 2 both as
``[D, keys]``, 3 K as rows and V as ``[D, keys]`` (A/B on the device; the same sums).

Grid ``(H_kv, requests, splits)``; each program writes fp32 ``(acc, max, sum)`` partials in
:func:`hwkv_cuda.kernels.attention.reduce_kernel`'s layout, which merges them (one split: it normalises).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["min_seg", "stride_bt"])
def fma_decode_kernel(
    q_ptr, kv_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    min_seg, qk_scale, stride_scale, num_heads,
    stride_qt, stride_qh, stride_blk, stride_kv, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, KV_FP8: tl.constexpr, MODE: tl.constexpr = 1,
):
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    seg = (seq_len + tl.num_programs(2) - 1) // tl.num_programs(2)
    seg = tl.maximum((seg + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_seg)
    lo = split * seg
    hi = tl.minimum(lo + seg, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    g_ok = offs_g < G
    d_mask = offs_d < HEAD_SIZE
    head = kvh * G + offs_g
    scale = qk_scale
    v_scale = 1.0
    if KV_FP8:
        scale = scale * tl.load(kv_scale_ptr + kvh)
        v_scale = tl.load(kv_scale_ptr + stride_scale + kvh)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_mask[None, :], other=0.0).to(tl.float32) * scale
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kvh_off = kvh.to(tl.int64) * stride_head

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        blk = tl.load(bt_ptr + pos // BS, mask=n_mask, other=0).to(tl.int64)
        off = blk * stride_blk + (pos % BS) * stride_tok + kvh_off
        ld = n_mask[:, None] & d_mask[None, :]
        if MODE == 2:  # K as [D, keys]: the reduction over D is the product's middle axis
            kt = tl.load(kv_ptr + off[None, :] + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :],
                         other=0.0).to(tl.float32)
            s = tl.sum(q[:, :, None] * kt[None, :, :], 1)
        else:
            k = tl.load(kv_ptr + off[:, None] + offs_d[None, :], mask=ld, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], 2)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE >= 2:  # V as [D, keys]: the reduction over keys is the product's last axis
            vt = tl.load(kv_ptr + stride_kv + off[None, :] + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :],
                         other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, None, :] * vt[None, :, :], 2)
        else:
            v = tl.load(kv_ptr + stride_kv + off[:, None] + offs_d[None, :], mask=ld, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    acc = acc * v_scale
    # partials [tokens, num_heads, NUM_SPLITS_PAD, (D_PAD | 2)] (token = request here); an empty split writes (-inf, 0)
    row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS_PAD + split
    tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)

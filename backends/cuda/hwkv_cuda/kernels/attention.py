"""Unified paged attention (Triton): prefill, chunked prefill on a cached prefix, decode and mixes
of them in one launch, plus the log-sum-exp reduction for split-KV.

One program owns ``BLOCK_Q`` query tokens of one request times all ``G`` query heads of one KV head:
tile row ``r`` is token ``r // HPAD``, head ``r % HPAD`` (``HPAD = BLOCK_M // BLOCK_Q >= G``), so each
KV block is read once per KV head; a decode packs its ``G`` heads into the M dim of the tile.
Grid ``(q_blocks, H_kv, splits)``; split ``s`` covers KV ``[s * seg, (s + 1) * seg)``. With one
split the program writes the normalised output, otherwise ``(acc, max, sum)`` partials that
:func:`reduce_kernel` combines. The softmax runs in base 2 (``qk_scale = scale * log2(e)``, applied to fp32 scores).
KV positions below the first row's causal bound need no mask, so they run in a mask-free loop.
"""

import triton
import triton.language as tl


@triton.jit
def _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, start, kv_end, q_pos, kvh_off, stride_blk, stride_tok,
          stride_kv, offs_n, offs_d, d_mask, BS: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    kv_pos = start + offs_n
    if MASKED:
        n_mask = kv_pos < kv_end
        blk = tl.load(bt_ptr + kv_pos // BS, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + kv_pos // BS).to(tl.int64)
    off = blk * stride_blk + (kv_pos % BS) * stride_tok + kvh_off
    if MASKED:
        k = tl.load(kv_ptr + off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    else:
        k = tl.load(kv_ptr + off[None, :] + offs_d[:, None], mask=d_mask[:, None], other=0.0)
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where((kv_pos[None, :] <= q_pos[:, None]) & n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(kv_ptr + stride_kv + off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                    other=0.0)
    else:
        v = tl.load(kv_ptr + stride_kv + off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


# runtime sizes that vary per batch are not specialised on (%16, ==1): fewer recompiles across batches
@triton.jit(do_not_specialize=["num_seqs", "seg_len", "stride_bt"])
def attention_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    num_seqs, seg_len, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_blk, stride_kv, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # last (longest causal) q blocks first: shorter tail
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    HPAD: tl.constexpr = BLOCK_M // BLOCK_Q

    # which request owns this q block, from query_start_loc alone (no planner tensor, so nothing a
    # captured graph reads can be freed under it): request s owns blocks from qsl[s] // BLOCK_Q + s on
    # (qsl[s] with BLOCK_Q 1); the grid is that upper bound, and surplus blocks get an empty tile
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        ok = first <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    seq = lo
    first = tl.load(query_start_loc_ptr + seq)
    if BLOCK_Q > 1:
        first = first // BLOCK_Q + seq
    qb = pid - first
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_SIZE
    tok = qb * BLOCK_Q + offs_m // HPAD
    head = kvh * G + offs_m % HPAD
    row_ok = (tok < q_len) & (offs_m % HPAD < G)
    q_pos = ctx_len + tok
    q_idx = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    # KV range of this program: causal bound of the tile's last token, cut to this split
    kv_end = tl.minimum(seq_len, ctx_len + (qb + 1) * BLOCK_Q)
    lo_kv = split * seg_len
    hi_kv = tl.minimum(lo_kv + seg_len, kv_end)
    hi_kv = tl.where(qb * BLOCK_Q < q_len, hi_kv, lo_kv)  # surplus q block: no KV work, no rows
    free_end = tl.minimum(ctx_len + qb * BLOCK_Q + 1, hi_kv)  # every row sees keys < free_end
    n_free = tl.maximum(free_end - lo_kv, 0) // BLOCK_N
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kvh_off = kvh.to(tl.int64) * stride_head

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for i in range(n_free):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, lo_kv + i * BLOCK_N, hi_kv, q_pos, kvh_off,
                              stride_blk, stride_tok, stride_kv, offs_n, offs_d, d_mask, BS, False, IEEE)
    for start in range(lo_kv + n_free * BLOCK_N, hi_kv, BLOCK_N):
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, start, hi_kv, q_pos, kvh_off,
                              stride_blk, stride_tok, stride_kv, offs_n, offs_d, d_mask, BS, True, IEEE)

    if SPLIT:
        # partials [num_tokens, num_heads, NUM_SPLITS_PAD, (D_PAD | 2)]; empty splits write (-inf, 0)
        row = (q_idx * (G * tl.num_programs(1)) + head) * NUM_SPLITS_PAD + split
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(out_ptr + q_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, num_heads, num_splits,
                  HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    row = (t * num_heads + h) * NUM_SPLITS_PAD + offs_s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - m_max)  # splits that saw nothing have m = -inf -> weight 0
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)

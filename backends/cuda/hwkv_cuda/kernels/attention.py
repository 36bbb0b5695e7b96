"""Unified paged attention (Triton): prefill, chunked prefill on a cached prefix, decode and mixes
of them in one launch, plus the log-sum-exp merge of split-KV partials.

One program owns ``BLOCK_Q`` query tokens of one request times all ``G`` query heads of one KV head:
tile row ``r`` is token ``r // HPAD``, head ``r % HPAD`` (``HPAD = BLOCK_M // BLOCK_Q >= G``), so each
KV block is read once per KV head; a decode packs its ``G`` heads into the M dim of the tile.
Grid ``(q_blocks, H_kv, splits)``. With one split the program writes the normalised output. With
several, split ``s`` of a request covers KV ``[s * seg, (s + 1) * seg)`` where ``seg`` comes from the
request's own length on the device (so a graph captured at an upper bound still spreads a short
request over the splits); each program writes fp32 ``(acc, max, sum)`` partials, and either the last
program of its (q block, KV head) to arrive merges them (``FUSED``, one launch: see the comment at the
counter) or :func:`reduce_kernel` does in a second launch. The softmax runs in base 2
(``qk_scale = scale * log2(e)``, applied to fp32 scores). KV positions below the first row's causal
bound need no mask, so they run in a mask-free loop.
"""

import triton
import triton.language as tl

from hwkv_cuda.kernels.dense import gdc_launch_dependents, gdc_wait


@triton.jit
def _e4m3_to_f16(c):
    """e4m3 codes (int32 in [0, 256)) as float16 values 2^-8 times theirs, exactly: e4m3's 4-bit
    exponent and 3 mantissa bits dropped into fp16's fields (bias 15 instead of 7) scale every code,
    subnormals included, by the same 2^-8. The caller folds the 256 into its scale."""
    return (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _unpack_e4m3(w, dtype: tl.constexpr):
    """int16 words ``[N, D / 2]`` of two e4m3 codes (little endian: the low byte is the even element) as
    ``[N, D]`` of ``dtype``, 2^-8 times their values (exact in fp16, bf16 and fp32). The cache reaches
    shared memory and registers as 16-bit words, and the 8-to-16-bit step is register arithmetic, not
    an 8-bit operand path into the MMA."""
    w = w.to(tl.int32)
    lo = _e4m3_to_f16(w & 0xFF)
    hi = _e4m3_to_f16((w >> 8) & 0xFF)
    x = tl.reshape(tl.join(lo, hi), (w.shape[0], 2 * w.shape[1]))
    return x.to(dtype)


@triton.jit
def _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, start, kv_end, q_pos, kvh_off, stride_blk, stride_tok,
          stride_kv, offs_n, offs_d, d_mask, BS: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr,
          KV_FP8: tl.constexpr, window, cap2, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
          UNPACK: tl.constexpr = 0, offs_h=None, h_mask=None):
    kv_pos = start + offs_n
    if MASKED:
        n_mask = kv_pos < kv_end
        blk = tl.load(bt_ptr + kv_pos // BS, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + kv_pos // BS).to(tl.int64)
    off = blk * stride_blk + (kv_pos % BS) * stride_tok + kvh_off
    if UNPACK == 1 or UNPACK == 3:  # kv_ptr is an int16 view: [keys, D / 2] words of two e4m3 codes, to [D, keys]
        if MASKED:
            kw = tl.load(kv_ptr + off[:, None] + offs_h[None, :], mask=n_mask[:, None] & h_mask[None, :], other=0)
        else:
            kw = tl.load(kv_ptr + off[:, None] + offs_h[None, :], mask=h_mask[None, :], other=0)
        k = tl.trans(_unpack_e4m3(kw, q.dtype))
    elif UNPACK == 2 or UNPACK == 6:  # e4m3 rows [keys, D] cast, then transposed (the layout V has)
        if MASKED:
            k = tl.load(kv_ptr + off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        else:
            k = tl.load(kv_ptr + off[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        k = tl.trans(k.to(q.dtype))
    else:
        if MASKED:
            k = tl.load(kv_ptr + off[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0.0)
        else:
            k = tl.load(kv_ptr + off[None, :] + offs_d[:, None], mask=d_mask[:, None], other=0.0)
        if KV_FP8:  # e4m3 is exact in bf16/fp16/fp32; the K scale is folded into qk_scale, V's into the output
            k = k.to(q.dtype)  # modes 4 and 6: fp16, two codes per cvt.rn.f16x2.e4m3x2 on sm_89+
    if IEEE:
        qk = tl.dot(q, k, input_precision="ieee")
    else:
        qk = tl.dot(q, k)
    qk = qk * qk_scale
    if SOFTCAP:  # cap * tanh(s / cap) in base-2 units (cap2 = cap * log2 e); tanh from exp2, fp32
        qk = cap2 * (1.0 - 2.0 / (tl.math.exp2(qk * (2.0 * 1.4426950408889634 / cap2)) + 1.0))
    if MASKED:
        visible = (kv_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if WINDOW:  # a query at p sees keys in (p - window, p]
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_FP8:
        # V pages are stored transposed (hwkv.interfaces.kv_quant): a block's V half is [H_kv, D, BS], each
        # head's codes key-contiguous per dim, so the [D, keys] tile is K-major for the PV dot, as K's tile is
        # for QK^T: one shared-memory crossing (cp.async, then the operand's own loads and a register cast),
        # where token-major V rows took three (the copy, a cast and 16-bit store, ldmatrix.trans)
        if UNPACK == 1 or UNPACK == 3:  # kv_ptr is an int16 view: its offsets count words
            kv8_ptr = kv_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
            voff = 2 * (blk * stride_blk + stride_kv + kvh_off * BS) + kv_pos % BS
        else:
            kv8_ptr = kv_ptr  # (a cast pointer would lose its 16-byte alignment: byte loads)
            voff = blk * stride_blk + stride_kv + kvh_off * BS + kv_pos % BS
        # Every tile starts at a multiple of BLOCK_N without a window (lo_kv: whole tiles per split), so the keys
        # run in groups of gcd(BS, BLOCK_N) consecutive bytes of one page, as aligned: vector copies, not byte loads
        N: tl.constexpr = offs_n.shape[0]  # (block sizes and key tiles are multiples of 16 here: 16 divides the gcd)
        VC: tl.constexpr = (BS if N % BS == 0 else (N if BS % N == 0 else 16)) if BS % 16 == 0 and N % 16 == 0 else 1
        if not WINDOW and VC > 1:
            voff = tl.max_contiguous(tl.multiple_of(voff, VC), VC)
        if MASKED:
            v = _vt_tile(kv8_ptr, voff, offs_d, d_mask, n_mask, BS, True)
        else:
            v = _vt_tile(kv8_ptr, voff, offs_d, d_mask, None, BS, False)
        v = v.to(q.dtype)  # transposed first: the cast then runs on the dot operand's own registers
    else:
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


@triton.jit
def _vt_tile(kv8_ptr, voff, offs_d, d_mask, n_mask, BS: tl.constexpr, MASKED: tl.constexpr):
    """V's ``[keys, D]`` e4m3 tile from transposed pages: ``voff`` ``[keys]`` is each key's byte in its
    block's ``[H_kv, D, BS]`` V half at dim 0 (dim ``d`` is ``d * BS`` further). Loaded as ``[D, keys]``.
    The caller gives ``voff``'s contiguity hints (made in here they did not reach the load: byte loads)."""
    if MASKED:
        vt = tl.load(kv8_ptr + voff[None, :] + offs_d[:, None] * BS, mask=n_mask[None, :] & d_mask[:, None], other=0.0)
    else:
        vt = tl.load(kv8_ptr + voff[None, :] + offs_d[:, None] * BS, mask=d_mask[:, None], other=0.0)
    return tl.trans(vt)


@triton.jit
def _rows(bt_ptr, pos, hi, kvh_off, stride_blk, stride_tok, BS: tl.constexpr):
    """Cache offsets ``[BLOCK_N]`` of the keys at ``pos`` (masked past ``hi``) through the block table."""
    n_mask = pos < hi
    blk = tl.load(bt_ptr + pos // BS, mask=n_mask, other=0).to(tl.int64)
    return blk * stride_blk + (pos % BS) * stride_tok + kvh_off, n_mask


@triton.jit
def _tile_regs(acc, l_i, m_i, q, qk_scale, k, v, n_mask, d_mask, cap2, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """One tile of a decode whose K and V rows ``[keys, D]`` are already in registers (``PREFETCH``); keys
    past the split's end are ``n_mask`` false. fp8 rows are cast in their loaded layout (see ``UNPACK == 7``)."""
    if KV_FP8:
        k = tl.where(d_mask[None, :], k.to(q.dtype), 0.0)
        v = tl.where(d_mask[None, :], v.to(q.dtype), 0.0)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale
    if SOFTCAP:
        qk = cap2 * (1.0 - 2.0 / (tl.math.exp2(qk * (2.0 * 1.4426950408889634 / cap2)) + 1.0))
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _merge(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, qb, kvh, num_heads, num_splits, stride_ot, stride_oh,
           G: tl.constexpr, G_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr,
           BLOCK_Q: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr,
           ONE_PASS: tl.constexpr = False):
    """Merge the partials of one (q block, KV head): ``BLOCK_Q x G`` output rows, ``MERGE_ROWS`` at a
    time, splits in chunks of ``MERGE_SPLITS`` (a [rows, splits, D] load keeps many bytes in flight in
    one program). The math is :func:`reduce_kernel`'s: ``m* = max_s m_s``, ``w_s = 2^(m_s - m*)``,
    ``out = sum_s w_s acc_s / sum_s w_s l_s`` in fp32; only the order of the fp32 sums over splits
    may differ. Loads are ``.cg`` (L2, not L1): the partials were written by other SMs. ``ONE_PASS`` (every row
    and split in one load: ``BLOCK_Q * G_PAD <= MERGE_ROWS``, ``NUM_SPLITS_PAD <= MERGE_SPLITS``): the maxima, sums
    and accumulators are loaded at once - one round trip to L2 instead of two, the same values and sums."""
    offs_r = tl.arange(0, MERGE_ROWS)
    offs_c = tl.arange(0, MERGE_SPLITS)
    offs_s = tl.arange(0, NUM_SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    if ONE_PASS:
        tl.static_assert(BLOCK_Q * G_PAD <= MERGE_ROWS and NUM_SPLITS_PAD <= MERGE_SPLITS)
        tok = qb * BLOCK_Q + offs_r // G_PAD
        h = offs_r % G_PAD
        ok = (tok < q_len) & (h < G) & (offs_r < BLOCK_Q * G_PAD)
        head = kvh * G + h
        q_idx = (q_start + tok).to(tl.int64)
        sp = (q_idx * num_heads + head)[:, None] * NUM_SPLITS_PAD + offs_s[None, :]
        s_ok = ok[:, None] & (offs_s[None, :] < num_splits)
        m = tl.load(part_ml_ptr + sp * 2, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + sp * 2 + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
        a = tl.load(part_acc_ptr + sp[:, :, None] * D_PAD + offs_d[None, None, :], mask=s_ok[:, :, None], other=0.0,
                    cache_modifier=".cg")
        m_max = tl.max(m, 1)
        m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
        w = tl.math.exp2(m - m_max[:, None])
        l_sum = tl.sum(l_s * w, 1)
        o = tl.zeros([MERGE_ROWS, D_PAD], tl.float32)
        o += tl.sum(a * w[:, :, None], 1)
        l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
        tl.store(out_ptr + q_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 (o / l_sum[:, None]).to(out_ptr.dtype.element_ty), mask=ok[:, None] & (offs_d[None, :] < HEAD_SIZE))
    else:
        for r0 in range(0, BLOCK_Q * G_PAD, MERGE_ROWS):
            rr = r0 + offs_r
            tok = qb * BLOCK_Q + rr // G_PAD
            h = rr % G_PAD
            ok = (tok < q_len) & (h < G)
            head = kvh * G + h
            q_idx = (q_start + tok).to(tl.int64)
            row = (q_idx * num_heads + head) * NUM_SPLITS_PAD  # partial row of split 0
            ml = part_ml_ptr + (row[:, None] + offs_s[None, :]) * 2
            s_ok = ok[:, None] & (offs_s[None, :] < num_splits)
            m = tl.load(ml, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(ml + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
            m_max = tl.max(m, 1)
            m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # rows outside the batch: no NaN
            l_sum = tl.sum(l_s * tl.math.exp2(m - m_max[:, None]), 1)
            o = tl.zeros([MERGE_ROWS, D_PAD], tl.float32)
            for c0 in range(0, num_splits, MERGE_SPLITS):
                sp = row[:, None] + c0 + offs_c[None, :]
                c_ok = ok[:, None] & (c0 + offs_c[None, :] < num_splits)
                w = tl.math.exp2(tl.load(part_ml_ptr + sp * 2, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
                                 - m_max[:, None])
                a = tl.load(part_acc_ptr + sp[:, :, None] * D_PAD + offs_d[None, None, :], mask=c_ok[:, :, None],
                            other=0.0, cache_modifier=".cg")
                o += tl.sum(a * w[:, :, None], 1)
            l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
            tl.store(out_ptr + q_idx[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     (o / l_sum[:, None]).to(out_ptr.dtype.element_ty),
                     mask=ok[:, None] & (offs_d[None, :] < HEAD_SIZE))


# runtime sizes that vary per batch are not specialised on (%16, ==1): fewer recompiles across batches
@triton.jit(do_not_specialize=["num_seqs", "min_seg", "stride_bt", "window"])
def attention_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    num_seqs, min_seg, qk_scale, stride_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_blk, stride_kv, stride_tok, stride_head, stride_bt,
    G: tl.constexpr, HEAD_SIZE: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, FUSED: tl.constexpr, NUM_SPLITS_PAD: tl.constexpr, G_PAD: tl.constexpr,
    MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
    KV_FP8: tl.constexpr = False, window=0, cap2=1.0, sinks_ptr=None,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, SINKS: tl.constexpr = False,
    UNPACK: tl.constexpr = 0, ONE_TOKEN: tl.constexpr = False, HEAD_MAJOR: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    tl.static_assert(not (EARLY and (KV_FP8 or PREFETCH or BLOCK_Q > 1)), "EARLY: one-token decodes of a 16-bit cache")
    if PDL:  # launched early beside the previous kernel: wait for its writes before reading anything
        gdc_launch_dependents()  # the next kernel only preloads weights before its own wait
        if not EARLY:  # EARLY: the wait comes after the first K/V tile's loads (below)
            gdc_wait()
    # grid (q blocks, KV heads, splits), or (KV heads, q blocks, splits) with HEAD_MAJOR: a request's KV heads
    # then run side by side, reading the same cache blocks at once (each head is 1/H_kv of every token's row)
    q_prog = tl.program_id(1) if HEAD_MAJOR else tl.program_id(0)
    n_kvh = tl.num_programs(0) if HEAD_MAJOR else tl.num_programs(1)
    pid = (tl.num_programs(1) if HEAD_MAJOR else tl.num_programs(0)) - 1 - q_prog  # last (longest causal) first
    kvh = tl.program_id(0) if HEAD_MAJOR else tl.program_id(1)
    split = tl.program_id(2)
    HPAD: tl.constexpr = BLOCK_M // BLOCK_Q

    # which request owns this q block, from query_start_loc alone (no planner tensor, so nothing a
    # captured graph reads can be freed under it): request s owns blocks from qsl[s] // BLOCK_Q + s on
    # (qsl[s] with BLOCK_Q 1); the grid is that upper bound, and surplus blocks get an empty tile
    lo = 0
    hi = num_seqs - 1
    if ONE_TOKEN:  # every request has exactly one query token (a pure decode): request = program
        lo = pid
        hi = pid
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
    q_ptrs = q_ptr + q_idx[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    if not EARLY:
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    # KV range of this program: causal bound of the tile's last token, cut to this split. The segment
    # follows this request's length (>= min_seg keys, whole BLOCK_N tiles), so the splits cover it
    # whatever upper bound the host planned with; splits past its end get an empty range
    kv_end = tl.minimum(seq_len, ctx_len + (qb + 1) * BLOCK_Q)
    # a sliding window starts the range at the first row's oldest visible key: a decode reads only the
    # window's blocks (those before it may be freed and their table entries stale), and the splits
    # share the window, not the whole context
    base = 0
    if WINDOW:
        base = tl.maximum(ctx_len + qb * BLOCK_Q - window + 1, 0)
    if SPLIT:
        seg = (seq_len - base + tl.num_programs(2) - 1) // tl.num_programs(2)
        seg = tl.maximum((seg + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_seg)
    else:
        seg = kv_end
    lo_kv = base + split * seg
    hi_kv = tl.minimum(lo_kv + seg, kv_end)
    hi_kv = tl.where(qb * BLOCK_Q < q_len, hi_kv, lo_kv)  # surplus q block: no KV work, no rows
    free_end = tl.minimum(ctx_len + qb * BLOCK_Q + 1, hi_kv)  # every row sees keys < free_end
    free_lo = lo_kv
    if WINDOW:  # keys from the last row's oldest visible one on are in every row's window
        last = ctx_len + tl.minimum(q_len, (qb + 1) * BLOCK_Q) - 1
        free_lo = tl.minimum(tl.maximum(last - window + 1, lo_kv), tl.maximum(free_end, lo_kv))
    n_free = tl.maximum(free_end - free_lo, 0) // BLOCK_N
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kvh_off = kvh.to(tl.int64) * stride_head
    v_scale = 1.0
    if KV_FP8:  # this KV head's dequantisation scales: K's multiplies the scores, V's the output
        qk_scale = qk_scale * tl.load(kv_scale_ptr + kvh)
        v_scale = tl.load(kv_scale_ptr + stride_scale + kvh)
        if UNPACK == 1 or UNPACK == 3:  # the unpacked K values are 2^-8 times the codes' (_e4m3_to_f16)
            qk_scale = qk_scale * 256.0
        if UNPACK >= 3 and q.dtype == tl.bfloat16:
            # fp16 dots with a bf16 query: no per-tile conversion to bf16 at all (3: the words' codes in
            # fp16 by bit arithmetic; 4 and 6: e4m3 tiles cast to fp16, which sm_89+ does two codes per
            # cvt.rn.f16x2.e4m3x2, where a cast to bf16 goes through fp16 and fp32). The query, 2^-8 times
            # itself, keeps its 8 significant bits in fp16 down to 2^-6 (and overflows only past 2^24)
            q = (q.to(tl.float32) * 0.00390625).to(tl.float16)
            qk_scale = qk_scale * 256.0
    offs_h = tl.arange(0, D_PAD // 2)
    h_mask = offs_h < HEAD_SIZE // 2

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:  # the head's sink is one more logit with a zero value: split 0 starts from it (m = sink, l = 1)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    if EARLY:
        # One query token per request (a pure decode; 16-bit cache): what this program reads before the PDL wait
        # does not depend on the kernels still running before it - query_start_loc, seq_lens and the block table
        # are the step's inputs, and the first tile's K/V rows were written by earlier steps, except the rows of
        # this step's token (position ctx_len on), which the previous kernel (the qkv GEMV's KV write) may still be
        # writing: those are loaded again after the wait. So the block id -> K/V chain of loads overlaps the
        # previous kernel's tail instead of following it. Every key in [lo_kv, hi_kv) is visible (as PREFETCH).
        pos = lo_kv + offs_n
        off, n_mask = _rows(bt_ptr, pos, hi_kv, kvh_off, stride_blk, stride_tok, BS)
        kv_rows = kv_ptr + off[:, None] + offs_d[None, :]
        ld = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_rows, mask=ld, other=0.0)
        v = tl.load(kv_rows + stride_kv, mask=ld, other=0.0)
        if PDL:
            gdc_wait()
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)
        fresh = ld & (pos >= ctx_len)[:, None]
        k = tl.where(fresh, tl.load(kv_rows, mask=fresh, other=0.0), k)
        v = tl.where(fresh, tl.load(kv_rows + stride_kv, mask=fresh, other=0.0), v)
        acc, l_i, m_i = _tile_regs(acc, l_i, m_i, q, qk_scale, k, v, n_mask, d_mask, cap2, IEEE, False, SOFTCAP)
        for start in range(lo_kv + BLOCK_N, hi_kv, BLOCK_N):  # a split longer than one tile: the plain tiles
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, start, hi_kv, q_pos, kvh_off,
                                  stride_blk, stride_tok, stride_kv, offs_n, offs_d, d_mask, BS, True, IEEE, False,
                                  window, cap2, WINDOW, SOFTCAP)
    elif PREFETCH:
        # One query token per program (BLOCK_Q == 1): every key in [lo_kv, hi_kv) is visible (the window's
        # edge is lo_kv's base), so one masked loop. Software pipelined by hand: while a tile's dots run,
        # the next tile's K/V loads are in flight, and their block ids were loaded one iteration earlier -
        # no block id -> K -> V chain of dependent loads in front of any tile's math (Triton's pipeliner
        # gives such an indirect load one buffer at num_stages <= 4: nothing overlapped).
        pos = lo_kv + offs_n
        off, n_mask = _rows(bt_ptr, pos, hi_kv, kvh_off, stride_blk, stride_tok, BS)
        k = tl.load(kv_ptr + off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        VC: tl.constexpr = (BS if BLOCK_N % BS == 0 else (BLOCK_N if BS % BLOCK_N == 0 else 16)) \
            if BS % 16 == 0 and BLOCK_N % 16 == 0 else 1  # as in _tile
        if KV_FP8:  # V pages stored [H_kv, D, BS]: from the row offset to the key's byte in its head's V^T page
            voff = off + stride_kv + kvh_off * (BS - 1) + (pos % BS) * (1 - stride_tok)
            if not WINDOW and VC > 1:  # whole tiles from lo_kv (as in _tile)
                voff = tl.max_contiguous(tl.multiple_of(voff, VC), VC)
            v = _vt_tile(kv_ptr, voff, offs_d, d_mask, n_mask, BS, True)
        else:
            v = tl.load(kv_ptr + stride_kv + off[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :],
                        other=0.0)
        pos1 = pos + BLOCK_N
        off1, n_mask1 = _rows(bt_ptr, pos1, hi_kv, kvh_off, stride_blk, stride_tok, BS)
        for _ in range(tl.cdiv(tl.maximum(hi_kv - lo_kv, 0), BLOCK_N)):
            k1 = tl.load(kv_ptr + off1[:, None] + offs_d[None, :], mask=n_mask1[:, None] & d_mask[None, :],
                         other=0.0)
            if KV_FP8:
                voff = off1 + stride_kv + kvh_off * (BS - 1) + (pos1 % BS) * (1 - stride_tok)
                if not WINDOW and VC > 1:
                    voff = tl.max_contiguous(tl.multiple_of(voff, VC), VC)
                v1 = _vt_tile(kv_ptr, voff, offs_d, d_mask, n_mask1, BS, True)
            else:
                v1 = tl.load(kv_ptr + stride_kv + off1[:, None] + offs_d[None, :],
                             mask=n_mask1[:, None] & d_mask[None, :], other=0.0)
            pos1 = pos1 + BLOCK_N
            off2, n_mask2 = _rows(bt_ptr, pos1, hi_kv, kvh_off, stride_blk, stride_tok, BS)
            acc, l_i, m_i = _tile_regs(acc, l_i, m_i, q, qk_scale, k, v, n_mask, d_mask, cap2, IEEE, KV_FP8,
                                       SOFTCAP)
            k = k1
            v = v1
            n_mask = n_mask1
            off1 = off2
            n_mask1 = n_mask2
    else:
        if WINDOW:  # the band's lower edge: keys some rows of the tile no longer see
            for start in range(lo_kv, free_lo, BLOCK_N):
                acc, l_i, m_i = _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, start, free_lo, q_pos, kvh_off,
                                      stride_blk, stride_tok, stride_kv, offs_n, offs_d, d_mask, BS, True, IEEE, KV_FP8,
                                      window, cap2, WINDOW, SOFTCAP, UNPACK, offs_h, h_mask)
        for i in range(n_free):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, free_lo + i * BLOCK_N, hi_kv, q_pos,
                                  kvh_off, stride_blk, stride_tok, stride_kv, offs_n, offs_d, d_mask, BS, False, IEEE,
                                  KV_FP8, window, cap2, WINDOW, SOFTCAP, UNPACK, offs_h, h_mask)
        for start in range(free_lo + n_free * BLOCK_N, hi_kv, BLOCK_N):
            acc, l_i, m_i = _tile(acc, l_i, m_i, q, qk_scale, kv_ptr, bt_ptr, start, hi_kv, q_pos, kvh_off,
                                  stride_blk, stride_tok, stride_kv, offs_n, offs_d, d_mask, BS, True, IEEE, KV_FP8,
                                  window, cap2, WINDOW, SOFTCAP, UNPACK, offs_h, h_mask)

    if KV_FP8:
        acc = acc * v_scale
    if SPLIT:
        # partials [num_tokens, num_heads, NUM_SPLITS_PAD, (D_PAD | 2)]; empty splits write (-inf, 0)
        row = (q_idx * (G * n_kvh) + head) * NUM_SPLITS_PAD + split
        tl.store(part_acc_ptr + row[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        if FUSED:
            # Last split reduces. Every split of this (q block, KV head), empty ones included, bumps one
            # int32 counter after storing its partials; the program that sees num_splits - 1 is the
            # last, merges all partials and resets the counter to 0 for the next launch (eager or a
            # graph replay: launches on a stream do not overlap). Ordering: Triton issues a scalar
            # atomic from one thread, so the barrier first makes every thread's partial stores precede
            # it (bar.sync orders the CTA's memory operations; a gpu-scope release is cumulative over
            # them). The acq_rel atomic then publishes them (release) to whoever increments after it
            # and, in the last program, acquires everything the earlier splits released; the second
            # barrier carries that acquire to all of its threads, whose loads bypass L1 (.cg). No
            # program ever waits for another, so there is no deadlock whatever the residency.
            tl.debug_barrier()
            cnt = counter_ptr + q_prog * n_kvh + kvh
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(2) - 1:
                tl.debug_barrier()
                _merge(out_ptr, part_acc_ptr, part_ml_ptr, q_start, q_len, qb, kvh, G * n_kvh,
                       tl.num_programs(2), stride_ot, stride_oh, G, G_PAD, HEAD_SIZE, D_PAD, BLOCK_Q,
                       NUM_SPLITS_PAD, MERGE_ROWS, MERGE_SPLITS,
                       EARLY and BLOCK_Q * G_PAD <= MERGE_ROWS and NUM_SPLITS_PAD <= MERGE_SPLITS)
                tl.store(cnt, 0)
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


@triton.jit
def _heads_tile(acc, l_i, m_i, qt, scale_h, kv_ptr, bt_ptr, start, hi, stride_blk, stride_kv, stride_tok, stride_head,
                offs_n, h3, d_mid, d_last, hd_ok, HKV: tl.constexpr, HEAD_SIZE: tl.constexpr, BS: tl.constexpr,
                MASKED: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    """One key tile of :func:`decode_heads_kernel`: every KV head's keys ``[start, start + BLOCK_N)``, those from
    ``hi`` on masked (``MASKED``; whole tiles load without a key mask, so V's runs of keys load as vectors)."""
    BLOCK_N: tl.constexpr = offs_n.shape[0]
    pos = start + offs_n
    n_ok = pos < hi
    if BLOCK_N % BS == 0:  # tiles start at multiples of BLOCK_N (whole tiles per split), so of BS
        idx = start // BS + offs_n // BS
        slot = offs_n % BS
    else:
        idx = pos // BS
        slot = pos % BS
    if MASKED:
        blk = tl.load(bt_ptr + idx, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + idx).to(tl.int64)
    row = blk * stride_blk + slot * stride_tok  # [keys]: the token's K row (every head)
    kmask = (h3 < HKV) & (d_last < HEAD_SIZE)
    if MASKED:
        kmask = kmask & n_ok[None, :, None]
    k = tl.load(kv_ptr + row[None, :, None] + h3 * stride_head + d_last, mask=kmask, other=0.0)
    k = k.to(qt.dtype)
    if IEEE:
        st = tl.dot(k, qt, input_precision="ieee")
    else:
        st = tl.dot(k, qt)
    st = st * scale_h[:, None, None]
    if MASKED:
        st = tl.where(n_ok[None, :, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(st - m_safe[:, None, :])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    vmask = hd_ok
    if MASKED:
        vmask = vmask & n_ok[None, None, :]
    if KV_FP8:  # V pages [H_kv, D, BS]: a block's V half is every head's [D, BS] page
        vrow = blk * stride_blk + stride_kv + slot
        if BLOCK_N % BS == 0 and BS % 16 == 0:  # keys in runs of BS consecutive bytes, aligned (as _tile)
            vrow = tl.max_contiguous(tl.multiple_of(vrow, BS), BS)
        vt = tl.load(kv_ptr + vrow[None, None, :] + h3 * (HEAD_SIZE * BS) + d_mid * BS, mask=vmask, other=0.0)
    else:
        vrow = blk * stride_blk + stride_kv + slot * stride_tok
        vt = tl.load(kv_ptr + vrow[None, None, :] + h3 * stride_head + d_mid, mask=vmask, other=0.0)
    vt = vt.to(qt.dtype)
    if IEEE:
        acc = acc * alpha[:, None, :] + tl.dot(vt, p.to(vt.dtype), input_precision="ieee")
    else:
        acc = acc * alpha[:, None, :] + tl.dot(vt, p.to(vt.dtype))
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["min_seg"])
def decode_heads_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
    min_seg, qk_scale, stride_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_blk, stride_kv, stride_tok, stride_head, stride_bt,
    HKV: tl.constexpr, H_PAD: tl.constexpr, G: tl.constexpr, GN: tl.constexpr, HEAD_SIZE: tl.constexpr,
    D_PAD: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr, G_PAD: tl.constexpr, MERGE_ROWS: tl.constexpr, MERGE_SPLITS: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr = False, KV_FP8: tl.constexpr = False, F16: tl.constexpr = False,
):
    """A pure decode (one query token per request, no window / soft-cap / sinks) whose program owns one request's
    split with **every KV head** (``TileConfig.all_heads``): a tile is ``[H_kv, keys, D]``, the K rows of all heads
    of a token side by side as they are stored, so each block's K half (and an fp8 cache's whole V half) is read
    at once by one program instead of in 64-byte pieces by H_kv programs at unrelated times. Per head the keys run
    in the MMA's M dimension: batched dots ``S^T = K Q^T`` ``[H_kv, keys, GN]`` and
    ``O^T += V^T P^T`` ``[H_kv, D, GN]``, the G heads of a KV head padded to ``GN >= 8`` columns. Grid
    ``(requests, splits)``; partials and the fused merge as :func:`attention_kernel`'s (the last split merges
    every KV head's rows). ``F16``: a bf16 query runs fp16 dots (as ``UNPACK >= 3``)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    seq = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if SPLIT:
        seg = (seq_len + tl.num_programs(1) - 1) // tl.num_programs(1)
        seg = tl.maximum((seg + BLOCK_N - 1) // BLOCK_N * BLOCK_N, min_seg)
    else:
        seg = seq_len
    lo_kv = split * seg
    hi_kv = tl.minimum(lo_kv + seg, seq_len)

    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_g = tl.arange(0, GN)
    offs_n = tl.arange(0, BLOCK_N)
    h3 = offs_h[:, None, None]
    d_mid = offs_d[None, :, None]
    g_last = offs_g[None, None, :]
    hd_ok = (h3 < HKV) & (d_mid < HEAD_SIZE)
    # the query transposed per KV head: [H_kv, D, GN], column g = query head h * G + g
    q_idx = seq.to(tl.int64)
    qt = tl.load(q_ptr + q_idx * stride_qt + (h3 * G + g_last) * stride_qh + d_mid, mask=hd_ok & (g_last < G),
                 other=0.0)
    h_ok = offs_h < HKV
    scale_h = tl.full([H_PAD], 1.0, tl.float32) * qk_scale
    v_scale = tl.full([H_PAD], 1.0, tl.float32)
    if KV_FP8:
        scale_h = scale_h * tl.load(kv_scale_ptr + offs_h, mask=h_ok, other=1.0)
        v_scale = tl.load(kv_scale_ptr + stride_scale + offs_h, mask=h_ok, other=1.0)
    if F16:  # the query 2^-8 times itself in fp16 (attention_kernel, UNPACK >= 3)
        qt = (qt.to(tl.float32) * 0.00390625).to(tl.float16)
        scale_h = scale_h * 256.0
    bt_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([H_PAD, GN], float("-inf"), tl.float32)
    l_i = tl.zeros([H_PAD, GN], tl.float32)
    acc = tl.zeros([H_PAD, D_PAD, GN], tl.float32)
    d_last = offs_d[None, None, :]
    n_whole = tl.maximum(hi_kv - lo_kv, 0) // BLOCK_N
    for i in range(n_whole):  # whole tiles unmasked (V's runs of keys load as vectors), then one masked tail
        acc, l_i, m_i = _heads_tile(acc, l_i, m_i, qt, scale_h, kv_ptr, bt_ptr, lo_kv + i * BLOCK_N, hi_kv,
                                    stride_blk, stride_kv, stride_tok, stride_head, offs_n, h3, d_mid, d_last, hd_ok,
                                    HKV, HEAD_SIZE, BS, False, IEEE, KV_FP8)
    for start in range(lo_kv + n_whole * BLOCK_N, hi_kv, BLOCK_N):
        acc, l_i, m_i = _heads_tile(acc, l_i, m_i, qt, scale_h, kv_ptr, bt_ptr, start, hi_kv, stride_blk, stride_kv,
                                    stride_tok, stride_head, offs_n, h3, d_mid, d_last, hd_ok, HKV, HEAD_SIZE, BS,
                                    True, IEEE, KV_FP8)
    acc = acc * v_scale[:, None, None]
    num_heads = HKV * G
    head2 = offs_h[:, None] * G + offs_g[None, :]  # [H_kv, GN]
    ok2 = h_ok[:, None] & (offs_g[None, :] < G)
    head3 = h3 * G + g_last
    ok3 = (h3 < HKV) & (g_last < G) & (d_mid < HEAD_SIZE)
    if SPLIT:
        prow2 = (q_idx * num_heads + head2) * NUM_SPLITS_PAD + split
        prow3 = (q_idx * num_heads + head3) * NUM_SPLITS_PAD + split
        tl.store(part_acc_ptr + prow3 * D_PAD + d_mid, acc, mask=(h3 < HKV) & (g_last < G))
        tl.store(part_ml_ptr + prow2 * 2, m_i, mask=ok2)
        tl.store(part_ml_ptr + prow2 * 2 + 1, l_i, mask=ok2)
        if FUSED:  # as attention_kernel: one counter per request; the last split merges every KV head's rows
            tl.debug_barrier()
            cnt = counter_ptr + seq
            arrived = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(1) - 1:
                tl.debug_barrier()
                for kvh in range(HKV):
                    _merge(out_ptr, part_acc_ptr, part_ml_ptr, seq, 1, 0, kvh, num_heads, tl.num_programs(1),
                           stride_ot, stride_oh, G, G_PAD, HEAD_SIZE, D_PAD, 1, NUM_SPLITS_PAD, MERGE_ROWS,
                           MERGE_SPLITS)
                tl.store(cnt, 0)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None, :]
        tl.store(out_ptr + q_idx * stride_ot + head3 * stride_oh + d_mid, out.to(out_ptr.dtype.element_ty), mask=ok3)

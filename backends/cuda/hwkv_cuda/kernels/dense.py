"""Small-batch dense kernel (Triton) for decode steps: ``y = epilogue(prologue(x) @ W^T)``.

At a handful of tokens a projection is a GEMV: time is the weight read plus a fixed ramp (launch,
first DRAM round trip, tail wave), and the elementwise kernels around it are pure ramp. This kernel
folds them in — prologue: the RMSNorm (``PROLOGUE=1``) or SiLU·mul (``2``) of the input; epilogue:
the residual add (``EPILOGUE=1``) or RoPE on q/k plus the k/v write into the paged cache (``2``) —
and is launched with programmatic dependent launch (``PDL``): its programs start during the previous
kernel's tail and wait (``gdc_wait``) only before reading activations; with ``PRELOAD`` the first
weight tile is loaded before that wait (weights never depend on the previous kernel), then (``1``) each
next tile after the current one's dot, or (``2``) the first tile's dot and a plain loop over the
rest; otherwise (``0``) the K loop is a plain one. (``num_stages`` does not pipeline these loops, which
have no dot: no async copies in any variant's TTGIR at sm_90 with Triton 3.6,
bench/results/issue36-s9-b1-b2-H200-2026-11-29-96753bc.md - so a K loop has one tile in flight a
program; ``dense_kernel_stream`` below gets its bytes in flight from several light programs.)

Every intermediate is rounded to the activation dtype where the unfused torch ops round
(hwkv/model/llama.py, rope.py), so only the dot product's summation order differs from them.

Tensor parallel (``RS`` = the world size, :class:`hwkv_cuda.decode_ops.TritonRankSum`): the row-parallel all-reduce
rides in the GEMVs instead of a kernel of its own. The row-parallel projection (``EPILOGUE=3``) stores its partial
output here and pushes it into its slot of every peer's buffer, then counts itself on this rank's own counter of the
call's site (release, system scope); the last program out adds one (release, system scope) to every peer's arrival
counter of the site - one NVLink atomic per peer and call (one per program, all on one word of the peer, made the path
slower than the push kernel: 3.468 vs 2.828 ms a tp=2 step on 2 x H200). The next projection (``PROLOGUE=1`` with
``RS``) waits, after its PDL wait, until every peer arrived (volatile polls, then one acquire), and forms its input
``h = residual + sum of the parts`` in rank order (the same bits on every rank, rounded as the push all-reduce),
program 0 storing ``h`` for the residual stream. The last program to finish resets the site's counter; two sites
alternate, so a site is written again only after every rank passed the call between (as the push all-reduce's
parities). A wait that never ends sets ``err`` instead of hanging.

A program owns ``BLOCK_N`` output rows as two halves ``a``/``b``: consecutive rows for the plain
epilogues; for RoPE the pair ``(i, i + D/2)`` of a head, so the rotation stays inside the program.
"""

import triton
import triton.language as tl

from hwkv_cuda.kernels.cache import to_e4m3_grid

try:  # Hopper's grid dependency control; absent from old Triton builds
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - PDL is then reported unavailable (hwkv_cuda.decode_ops)
    gdc_launch_dependents = gdc_wait = None


MAX_SPIN = tl.constexpr(1 << 28)  # polls before a rank-sum wait gives up (err set)


@triton.jit
def _rank_sum(x_ptr, buf_ptr, hres_ptr, offs_m, kk, mask, K, stride_xm, stride_hm, site, RANK: tl.constexpr,
              RS: tl.constexpr, SLOT: tl.constexpr):
    """``residual + sum over ranks`` of one ``[M_PAD, BLOCK_K]`` chunk (this rank's part at ``x_ptr``,
    each peer's in its slot of this rank's buffer): the float32 sum in rank order rounded, then the add
    rounded (as the push all-reduce's residual kernel). Returned in the activation dtype."""
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for r in tl.static_range(RS):
        if r == RANK:
            p = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=mask, other=0.0)
        else:
            p = tl.load(buf_ptr + (site * RS + r) * SLOT + offs_m[:, None] * K + kk[None, :], mask=mask, other=0.0)
        acc += p.to(tl.float32)
    dt = hres_ptr.dtype.element_ty
    res = tl.load(hres_ptr + offs_m[:, None] * stride_hm + kk[None, :], mask=mask, other=0.0)
    return (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)


@triton.jit
def _prologue(x_ptr, nw_ptr, k0, M, K, eps, stride_xm, rstd, offs_m, offs_k, PROLOGUE: tl.constexpr,
              ONE_TILE: tl.constexpr, buf_ptr=None, hres_ptr=None, hout_ptr=None, stride_hm=0, site=0, store_h=False,
              RANK: tl.constexpr = 0, RS: tl.constexpr = 0, SLOT: tl.constexpr = 0):
    """One ``[M_PAD, BLOCK_K]`` chunk of the GEMV input, as float32 holding dtype-rounded values
    (``RS``: the input is ``residual + sum over ranks``, stored to ``hout`` where ``store_h``)."""
    kk = k0 + offs_k
    mask = (offs_m[:, None] < M) & (kk[None, :] < K)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + kk[None, :]
    if RS > 0:
        x = _rank_sum(x_ptr, buf_ptr, hres_ptr, offs_m, kk, mask, K, stride_xm, stride_hm, site, RANK, RS, SLOT)
        if store_h:
            tl.store(hout_ptr + offs_m[:, None] * stride_hm + kk[None, :], x, mask=mask)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    dt = x.dtype
    out = x.to(tl.float32)
    if PROLOGUE == 1:  # rms_norm: normalise in fp32, round, scale by the weight, round
        if ONE_TILE:  # the whole row is this tile: no separate pass for the mean square
            rstd = tl.rsqrt(tl.sum(out * out, axis=1) / K + eps)
        nw = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        xn = (out * rstd[:, None]).to(dt).to(tl.float32)
        out = (nw[None, :] * xn).to(dt).to(tl.float32)
    if PROLOGUE == 2:  # silu(gate) * up over the [gate | up] row
        u = tl.load(ptrs + K, mask=mask, other=0.0).to(tl.float32)
        s = (out / (1.0 + tl.exp(-out))).to(dt).to(tl.float32)
        out = (s * u).to(dt).to(tl.float32)
    return out


@triton.jit
def _wload(ptrs, mask, EVICT: tl.constexpr):
    # weights are read once per step: evict-first keeps them from pushing activations out of L2 (A/B: ``evict``)
    if EVICT:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _rows_dot(w, x, offs_m, acc, M_PAD: tl.constexpr):
    # rows of x (at most 8) one at a time: a [M, N, K] broadcast would not fit the registers
    wf = w.to(tl.float32)
    for m in tl.static_range(M_PAD):
        xm = tl.sum(tl.where(offs_m[:, None] == m, x, 0.0), axis=0)
        part = tl.sum(wf * xm[None, :], axis=1)
        acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    return acc


@triton.jit
def _store_kv(base, rows, val, s_ok, kv_ptr, N, stride_kv, stride_head, scale_ptr, stride_scale,
              HEAD: tl.constexpr, Q_N: tl.constexpr, KV_N: tl.constexpr, KV_FP8: tl.constexpr, tok=None,
              stride_tok=0, BS: tl.constexpr = 1):
    r = rows - Q_N
    is_kv = (r >= 0) & (r < 2 * KV_N) & (rows < N)
    which = tl.where(r >= KV_N, 1, 0)
    rr = tl.where(is_kv, r - which * KV_N, 0)
    dst = base + (which * stride_kv + (rr // HEAD) * stride_head + rr % HEAD)[None, :]
    if KV_FP8:  # as write_kv_kernel: IEEE division by the head's K or V scale, saturated, RNE
        # V pages stored [H_kv, D, BS] (hwkv.interfaces.kv_quant): V's code of (token t, head h, dim d) at
        # h * D * BS + d * BS + t of the block's V half, where base holds t * stride_tok
        vt = (rr // HEAD) * stride_head * (BS - 1) + (rr % HEAD) * (BS - 1)
        dst += (which * vt)[None, :] + (which[None, :] * (tok * (1 - stride_tok))[:, None])
        s = tl.load(scale_ptr + which * stride_scale + rr // HEAD, mask=is_kv, other=1.0)
        val = to_e4m3_grid(tl.fdiv(val.to(tl.float32), s[None, :], ieee_rounding=True))
    tl.store(dst, val.to(kv_ptr.dtype.element_ty), mask=s_ok & is_kv[None, :])


@triton.jit
def _tile_rows(t, j, EPILOGUE: tl.constexpr, HEAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows of tile ``t`` as halves ``a``/``b`` (``j`` = arange(BLOCK_N // 2)): consecutive for the plain
    epilogues; for RoPE (``EPILOGUE == 2``) the pairs g = (head, i): rows head*D + i and head*D + i + D/2."""
    if EPILOGUE == 2:
        g = t * (BLOCK_N // 2) + j
        rows_a = (g // (HEAD // 2)) * HEAD + g % (HEAD // 2)
        rows_b = rows_a + HEAD // 2
    else:
        rows_a = t * BLOCK_N + j
        rows_b = rows_a + BLOCK_N // 2
    return rows_a, rows_b


@triton.jit
def _rope_tables(cos_ptr, sin_ptr, pos, rows_a, m_ok, stride_cos, HEAD: tl.constexpr, Q_N: tl.constexpr,
                 KV_N: tl.constexpr):
    """cos/sin of the pairs ``(rows_a, rows_a + D/2)`` at the tokens' positions, and which rows rotate (q, k)."""
    i_a = rows_a % HEAD
    rot = rows_a < Q_N + KV_N
    cmask = m_ok & rot[None, :]
    c_row = pos[:, None] * stride_cos
    ca = tl.load(cos_ptr + c_row + i_a[None, :], mask=cmask, other=1.0).to(tl.float32)
    sa = tl.load(sin_ptr + c_row + i_a[None, :], mask=cmask, other=0.0).to(tl.float32)
    cb = tl.load(cos_ptr + c_row + i_a[None, :] + HEAD // 2, mask=cmask, other=1.0).to(tl.float32)
    sb = tl.load(sin_ptr + c_row + i_a[None, :] + HEAD // 2, mask=cmask, other=0.0).to(tl.float32)
    return ca, sa, cb, sb, rot


@triton.jit
def _rope_kv(ya, yb, ca, sa, cb, sb, rot, rows_a, rows_b, slot, m_ok, kv_ptr, num_slots, N, stride_blk, stride_kv,
             stride_tok, stride_head, scale_ptr, stride_scale, HEAD: tl.constexpr, Q_N: tl.constexpr,
             KV_N: tl.constexpr, BS: tl.constexpr, KV_FP8: tl.constexpr):
    """neox RoPE on the q and k rows of the pair halves, op by op as apply_rope (a*c + rotate_half(a)*s, each
    rounded), and the k and v rows written to the cache slot of their token (slots outside [0, num_slots) skip)."""
    dt = ya.dtype
    fa, fb = ya.to(tl.float32), yb.to(tl.float32)
    ra = ((fa * ca).to(dt).to(tl.float32) - (fb * sa).to(dt).to(tl.float32)).to(dt)
    rb = ((fb * cb).to(dt).to(tl.float32) + (fa * sb).to(dt).to(tl.float32)).to(dt)
    ya = tl.where(rot[None, :], ra, ya)
    yb = tl.where(rot[None, :], rb, yb)
    s_ok = m_ok & (slot[:, None] >= 0) & (slot[:, None] < num_slots)
    s0 = tl.maximum(slot, 0)
    base = kv_ptr + (s0 // BS)[:, None] * stride_blk + (s0 % BS)[:, None] * stride_tok
    _store_kv(base, rows_a, ya, s_ok, kv_ptr, N, stride_kv, stride_head, scale_ptr, stride_scale, HEAD, Q_N, KV_N,
              KV_FP8, s0 % BS, stride_tok, BS)
    _store_kv(base, rows_b, yb, s_ok, kv_ptr, N, stride_kv, stride_head, scale_ptr, stride_scale, HEAD, Q_N, KV_N,
              KV_FP8, s0 % BS, stride_tok, BS)
    return ya, yb


@triton.jit
def _wait_arrivals(cnt, expect, err_ptr):
    """Until ``*cnt >= expect`` (bounded: ``err_ptr`` set instead of a hung device). Polled with plain
    volatile loads - every resident program of a GEMV polls the same word, and atomics on one address
    serialise - then one acquire read orders this program's reads of the peers' parts after the arrivals."""
    spins = 0
    while (tl.load(cnt, volatile=True) < expect) & (spins < MAX_SPIN):
        spins += 1
    if tl.atomic_add(cnt, 0, sem="acquire", scope="sys") < expect:
        tl.store(err_ptr, 1)
    tl.debug_barrier()


@triton.jit
def dense_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, cos_ptr, sin_ptr, pos_ptr, kv_ptr, slot_ptr,
    M, N, K, eps, num_slots,
    stride_xm, stride_ym, stride_rm, stride_cos,
    stride_blk, stride_kv, stride_tok, stride_head,
    PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD: tl.constexpr, Q_N: tl.constexpr, KV_N: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr,
    PRELOAD: tl.constexpr, ONE_TILE: tl.constexpr, scale_ptr=None, stride_scale=0, KV_FP8: tl.constexpr = False,
    buf_ptr=None, peers_ptr=None, cnt_ptr=None, err_ptr=None, hres_ptr=None, hout_ptr=None, stride_hm=0, site=0,
    expect=0, RANK: tl.constexpr = 0, WS: tl.constexpr = 1, RS: tl.constexpr = 0, SLOT: tl.constexpr = 0,
    CNT_OFF: tl.constexpr = 0, EVICT: tl.constexpr = 0, SPLIT_K: tl.constexpr = 1, part_ptr=None, sk_cnt_ptr=None,
):
    HB: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    sk = 0
    if SPLIT_K > 1:  # program = (row block, K split); K // SPLIT_K is a multiple of BLOCK_K (the host checks)
        sk = pid % SPLIT_K
        pid = pid // SPLIT_K
    k_lo = sk * (K // SPLIT_K)
    k_hi = k_lo + K // SPLIT_K
    j = tl.arange(0, HB)
    rows_a, rows_b = _tile_rows(pid, j, EPILOGUE, HEAD, BLOCK_N)
    ok_a, ok_b = rows_a < N, rows_b < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    w_a = w_ptr + rows_a.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_b = w_ptr + rows_b.to(tl.int64)[:, None] * K + offs_k[None, :]
    if PRELOAD:  # the first weight tile before the wait: it does not depend on the previous kernel
        wa = _wload(w_a + k_lo, ok_a[:, None] & (k_lo + offs_k[None, :] < k_hi), EVICT)
        wb = _wload(w_b + k_lo, ok_b[:, None] & (k_lo + offs_k[None, :] < k_hi), EVICT)
    m_ok = offs_m[:, None] < M
    if EPILOGUE == 2:  # before the wait too: positions, slots (the step's inputs) and the cos/sin tables
        # are not written by the kernels before this one - the pos -> cos/sin chain leaves the critical path
        pos = tl.load(pos_ptr + offs_m, mask=offs_m < M, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + offs_m, mask=offs_m < M, other=-1).to(tl.int64)
        ca, sa, cb, sb, rot = _rope_tables(cos_ptr, sin_ptr, pos, rows_a, m_ok, stride_cos, HEAD, Q_N, KV_N)
    if PDL:
        # let the next kernel's programs start now: before their own wait they only load weights,
        # so they stream those while this kernel (and the one it waits on) runs
        gdc_launch_dependents()
        gdc_wait()  # from here on we read what earlier kernels wrote
    if RS > 0:  # every peer's part of this site arrived (bounded: err instead of a hung device)
        _wait_arrivals(cnt_ptr + site, expect, err_ptr)
    # the epilogue's loads go out now, beside the weight stream, not after it
    if EPILOGUE == 1:
        ra = tl.load(res_ptr + offs_m[:, None] * stride_rm + rows_a[None, :], mask=m_ok & ok_a[None, :], other=0.0)
        rb = tl.load(res_ptr + offs_m[:, None] * stride_rm + rows_b[None, :], mask=m_ok & ok_b[None, :], other=0.0)
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if PROLOGUE == 1 and not ONE_TILE:
        ss = tl.zeros([M_PAD], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            xmask = (offs_m[:, None] < M) & (kk[None, :] < K)
            if RS > 0:
                xs = _rank_sum(x_ptr, buf_ptr, hres_ptr, offs_m, kk, xmask, K, stride_xm, stride_hm, site, RANK, RS,
                               SLOT).to(tl.float32)
            else:
                xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=xmask, other=0.0).to(tl.float32)
            ss += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc_a = tl.zeros([M_PAD, HB], dtype=tl.float32)
    acc_b = tl.zeros([M_PAD, HB], dtype=tl.float32)
    K0: tl.constexpr = (PRELOAD // 2) * BLOCK_K
    if PRELOAD == 2:  # the tile loaded before the wait first, then the loop over the rest
        x = _prologue(x_ptr, nw_ptr, k_lo, M, K, eps, stride_xm, rstd, offs_m, offs_k, PROLOGUE, ONE_TILE, buf_ptr,
                      hres_ptr, hout_ptr, stride_hm, site, pid == 0, RANK, RS, SLOT)
        acc_a = _rows_dot(wa, x, offs_m, acc_a, M_PAD)
        acc_b = _rows_dot(wb, x, offs_m, acc_b, M_PAD)
    for k0 in range(k_lo + K0, k_hi, BLOCK_K):
        if PRELOAD != 1:  # plain loads (not software-pipelined: no dot in the loop, see the module doc)
            kk = k0 + offs_k
            wa = _wload(w_a + k0, ok_a[:, None] & (kk[None, :] < k_hi), EVICT)
            wb = _wload(w_b + k0, ok_b[:, None] & (kk[None, :] < k_hi), EVICT)
        x = _prologue(x_ptr, nw_ptr, k0, M, K, eps, stride_xm, rstd, offs_m, offs_k, PROLOGUE, ONE_TILE, buf_ptr,
                      hres_ptr, hout_ptr, stride_hm, site, pid == 0, RANK, RS, SLOT)
        acc_a = _rows_dot(wa, x, offs_m, acc_a, M_PAD)
        acc_b = _rows_dot(wb, x, offs_m, acc_b, M_PAD)
        if PRELOAD == 1:  # the next tile (fully masked after the last)
            nk = k0 + BLOCK_K + offs_k
            wa = _wload(w_a + k0 + BLOCK_K, ok_a[:, None] & (nk[None, :] < k_hi), EVICT)
            wb = _wload(w_b + k0 + BLOCK_K, ok_b[:, None] & (nk[None, :] < k_hi), EVICT)

    out_ok = offs_m[:, None] >= 0  # every row; with SPLIT_K only the row block's last split stores
    if SPLIT_K > 1:
        # the float32 partial to the workspace [SPLIT_K, M_PAD, N]; the row block's last split to arrive (acq_rel
        # counter, reset by it) sums the partials in split order - the same bits whichever split is last
        tl.store(part_ptr + (sk * M_PAD + offs_m[:, None]) * N + rows_a[None, :], acc_a, mask=ok_a[None, :])
        tl.store(part_ptr + (sk * M_PAD + offs_m[:, None]) * N + rows_b[None, :], acc_b, mask=ok_b[None, :])
        tl.debug_barrier()  # every thread's partial stored before the arrival
        done = tl.atomic_add(sk_cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        last = (offs_m[:, None] * 0 + done) == SPLIT_K - 1  # [M_PAD, 1]
        acc_a = tl.zeros([M_PAD, HB], dtype=tl.float32)
        acc_b = tl.zeros([M_PAD, HB], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc_a += tl.load(part_ptr + (s * M_PAD + offs_m[:, None]) * N + rows_a[None, :],
                             mask=ok_a[None, :] & last, other=0.0, cache_modifier=".cg")
            acc_b += tl.load(part_ptr + (s * M_PAD + offs_m[:, None]) * N + rows_b[None, :],
                             mask=ok_b[None, :] & last, other=0.0, cache_modifier=".cg")
        if done == SPLIT_K - 1:
            tl.atomic_xchg(sk_cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
        out_ok = out_ok & last

    dt = x_ptr.dtype.element_ty  # the activation dtype (y may be wider: float32 logits, stored widened)
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + rows_a, mask=ok_a, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(b_ptr + rows_b, mask=ok_b, other=0.0).to(tl.float32)[None, :]
    ya = acc_a.to(dt)
    yb = acc_b.to(dt)
    if EPILOGUE == 1:  # residual + y, both rounded (as `out` then `h + out` in torch)
        ya = (ya.to(tl.float32) + ra.to(tl.float32)).to(dt)
        yb = (yb.to(tl.float32) + rb.to(tl.float32)).to(dt)
    if EPILOGUE == 2:
        ya, yb = _rope_kv(ya, yb, ca, sa, cb, sb, rot, rows_a, rows_b, slot, m_ok, kv_ptr, num_slots, N, stride_blk,
                          stride_kv, stride_tok, stride_head, scale_ptr, stride_scale, HEAD, Q_N, KV_N, BS, KV_FP8)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows_a[None, :], ya, mask=m_ok & ok_a[None, :] & out_ok)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows_b[None, :], yb, mask=m_ok & ok_b[None, :] & out_ok)
    if EPILOGUE == 3:  # the partial into this rank's slot of every peer's buffer, then one arrival on its counter
        for r in tl.static_range(WS):
            if r != RANK:
                peer = tl.load(peers_ptr + r).to(tl.pointer_type(dt)) + (site * WS + RANK) * SLOT
                tl.store(peer + offs_m[:, None] * N + rows_a[None, :], ya, mask=m_ok & ok_a[None, :])
                tl.store(peer + offs_m[:, None] * N + rows_b[None, :], yb, mask=m_ok & ok_b[None, :])
        tl.debug_barrier()  # every thread's stores before the arrival
        # one arrival per program on this rank's own counter (release, system scope: after its peer stores); the
        # last program (acquire: every other program's stores happen before its own release) carries the whole
        # call to every peer as one arrival - one NVLink atomic per peer instead of one per program, all on one
        # address of the peer's memory
        mine = tl.atomic_add(cnt_ptr + 4 + site, 1, sem="acq_rel", scope="sys")
        if mine == tl.num_programs(0) - 1:
            tl.atomic_xchg(cnt_ptr + 4 + site, 0, sem="relaxed", scope="gpu")  # its next use is two calls on
            for r in tl.static_range(WS):
                if r != RANK:
                    cnt = tl.load(peers_ptr + r).to(tl.pointer_type(tl.int64)) + CNT_OFF + site
                    tl.atomic_add(cnt, 1, sem="release", scope="sys")
    if RS > 0:  # the last program out resets the site's counter (every program is past its wait by then)
        done = tl.atomic_add(cnt_ptr + 2 + site, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.atomic_xchg(cnt_ptr + site, 0, sem="relaxed", scope="sys")
            tl.atomic_xchg(cnt_ptr + 2 + site, 0, sem="relaxed", scope="gpu")


@triton.jit
def rank_sum_kernel(x_ptr, buf_ptr, hres_ptr, hout_ptr, cnt_ptr, err_ptr, n, K, site, expect, RANK: tl.constexpr,
                    RS: tl.constexpr, SLOT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``hout = residual + sum over ranks`` of the last row-parallel projection's parts (the consumer half
    of ``dense_kernel``'s ``RS`` prologue, for the end of the forward); ``[M, K]`` contiguous, ``n = M K``."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    _wait_arrivals(cnt_ptr + site, expect, err_ptr)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(RS):
        if r == RANK:
            p = tl.load(x_ptr + offs, mask=mask, other=0.0)
        else:
            p = tl.load(buf_ptr + (site * RS + r) * SLOT + offs, mask=mask, other=0.0)
        acc += p.to(tl.float32)
    dt = hout_ptr.dtype.element_ty
    res = tl.load(hres_ptr + offs, mask=mask, other=0.0)
    tl.store(hout_ptr + offs, (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt), mask=mask)
    done = tl.atomic_add(cnt_ptr + 2 + site, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(cnt_ptr + site, 0, sem="relaxed", scope="sys")
        tl.atomic_xchg(cnt_ptr + 2 + site, 0, sem="relaxed", scope="gpu")



@triton.jit
def _stream_tile(w_ptr, t, j, offs_k, k_ok, N, K, EPILOGUE: tl.constexpr, HEAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 EVICT: tl.constexpr):
    """Row tile ``t`` of the weight as halves ``a``/``b`` (rows past N, so every row of a tile past the last: zeros)."""
    rows_a, rows_b = _tile_rows(t, j, EPILOGUE, HEAD, BLOCK_N)
    wa = _wload(w_ptr + rows_a.to(tl.int64)[:, None] * K + offs_k[None, :], (rows_a < N)[:, None] & k_ok[None, :],
                EVICT)
    wb = _wload(w_ptr + rows_b.to(tl.int64)[:, None] * K + offs_k[None, :], (rows_b < N)[:, None] & k_ok[None, :],
                EVICT)
    return wa, wb


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """One bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, sm_90+) of ``nbytes`` (a multiple of 16, 16-byte aligned)
    from ``ptr``, issued by the program's first thread: the bytes head for L2 without a register."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_tile(w_ptr, t, N, K, EPILOGUE: tl.constexpr, HEAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile ``t``'s weight rows toward L2: one prefetch per half (each half's rows are contiguous: consecutive rows,
    or for RoPE ``HB`` pairs inside one head's half); nothing past the last row."""
    rows_a, rows_b = _tile_rows(t, tl.arange(0, 1), EPILOGUE, HEAD, BLOCK_N)
    ra = tl.min(rows_a, axis=0)
    rb = tl.min(rows_b, axis=0)
    na = tl.minimum(N - ra, BLOCK_N // 2)
    nb = tl.minimum(N - rb, BLOCK_N // 2)
    row_bytes = K * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    if na > 0:
        _prefetch_l2(w_ptr + ra.to(tl.int64) * K, (na * row_bytes).to(tl.int32))
    if nb > 0:
        _prefetch_l2(w_ptr + rb.to(tl.int64) * K, (nb * row_bytes).to(tl.int32))


@triton.jit
def _tile_dot(wa, wb, x, offs_m, M_PAD: tl.constexpr, HB: tl.constexpr):
    return (_rows_dot(wa, x, offs_m, tl.zeros([M_PAD, HB], dtype=tl.float32), M_PAD),
            _rows_dot(wb, x, offs_m, tl.zeros([M_PAD, HB], dtype=tl.float32), M_PAD))


@triton.jit
def _stream_out(t, acc_a, acc_b, j, offs_m, m_ok, b_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, pos, slot, kv_ptr, N,
                num_slots, stride_ym, stride_rm, stride_cos, stride_blk, stride_kv, stride_tok, stride_head, scale_ptr,
                stride_scale, dt: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD: tl.constexpr, Q_N: tl.constexpr, KV_N: tl.constexpr, BS: tl.constexpr,
                KV_FP8: tl.constexpr):
    """Tile ``t`` of the persistent GEMV from its float32 dot products: the bias, the epilogue, the store (as
    ``dense_kernel``'s)."""
    rows_a, rows_b = _tile_rows(t, j, EPILOGUE, HEAD, BLOCK_N)
    ok_a, ok_b = rows_a < N, rows_b < N
    if HAS_BIAS:
        acc_a += tl.load(b_ptr + rows_a, mask=ok_a, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(b_ptr + rows_b, mask=ok_b, other=0.0).to(tl.float32)[None, :]
    ya = acc_a.to(dt)
    yb = acc_b.to(dt)
    if EPILOGUE == 1:
        ra = tl.load(res_ptr + offs_m[:, None] * stride_rm + rows_a[None, :], mask=m_ok & ok_a[None, :], other=0.0)
        rb = tl.load(res_ptr + offs_m[:, None] * stride_rm + rows_b[None, :], mask=m_ok & ok_b[None, :], other=0.0)
        ya = (ya.to(tl.float32) + ra.to(tl.float32)).to(dt)
        yb = (yb.to(tl.float32) + rb.to(tl.float32)).to(dt)
    if EPILOGUE == 2:
        ca, sa, cb, sb, rot = _rope_tables(cos_ptr, sin_ptr, pos, rows_a, m_ok, stride_cos, HEAD, Q_N, KV_N)
        ya, yb = _rope_kv(ya, yb, ca, sa, cb, sb, rot, rows_a, rows_b, slot, m_ok, kv_ptr, num_slots, N, stride_blk,
                          stride_kv, stride_tok, stride_head, scale_ptr, stride_scale, HEAD, Q_N, KV_N, BS, KV_FP8)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows_a[None, :], ya, mask=m_ok & ok_a[None, :])
    tl.store(y_ptr + offs_m[:, None] * stride_ym + rows_b[None, :], yb, mask=m_ok & ok_b[None, :])


@triton.jit
def dense_kernel_stream(  # named dense_kernel*: hwkv.bench.timeline labels the decode GEMVs by that prefix
    x_ptr, w_ptr, b_ptr, y_ptr, res_ptr, nw_ptr, cos_ptr, sin_ptr, pos_ptr, kv_ptr, slot_ptr,
    M, N, K, eps, num_slots, stride_xm, stride_ym, stride_rm, stride_cos, stride_blk, stride_kv, stride_tok,
    stride_head,
    PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HEAD: tl.constexpr, Q_N: tl.constexpr, KV_N: tl.constexpr,
    BS: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr, EVICT: tl.constexpr, scale_ptr=None, stride_scale=0,
    KV_FP8: tl.constexpr = False, STAGES: tl.constexpr = 1, L2PF: tl.constexpr = 0, CHUNKED: tl.constexpr = False,
):
    """``dense_kernel`` (``EPILOGUE`` 0, 1 or 2; no tensor-parallel sum) as a persistent GEMV: a grid of a few
    programs per SM (light: the whole-K input row(s) formed once, ``BLOCK_K >= K``, then one ``BLOCK_N`` x K weight
    tile at a time, so several programs fit an SM), each looping over row tiles ``pid, pid + programs, ...``
    instead of one register-heavy program per SM per tile and a gap between programs. ``PRE`` 1: the first tile is
    loaded before the PDL wait (weights never depend on the previous kernel) and each next tile before the current
    one's dot (two tiles in registers); 2: only the first tile before the wait (its iteration peeled off the loop,
    one tile in registers); 0: every tile after the wait. ``L2PF`` (sm_90+, not interpreted): 1 the first tile's
    rows go toward L2 by a bulk prefetch before the wait (no registers held), 2 as well the next tile's at the top of
    every iteration (the loop then reads from L2 what was prefetched an iteration earlier). ``STAGES`` > 1 asks
    Triton to software-pipeline the tile loop (``tl.range(num_stages=)``: async copies through shared memory, where
    the compiler does it for a loop without a dot - Triton 3.9 at sm_90 leaves it as is). ``CHUNKED`` (``BLOCK_K <
    K``, ``PRE`` 0): each tile's K in ``BLOCK_K`` chunks, the input chunk formed again for each (RMSNorm's mean square
    once a program) - the registers of one chunk instead of the whole row (down's 8192)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ntiles = tl.cdiv(N, BLOCK_N)
    j = tl.arange(0, BLOCK_N // 2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    k_ok = offs_k < K
    m_ok = offs_m[:, None] < M
    dt: tl.constexpr = x_ptr.dtype.element_ty
    if PRE > 0:
        wa_n, wb_n = _stream_tile(w_ptr, pid, j, offs_k, k_ok, N, K, EPILOGUE, HEAD, BLOCK_N, EVICT)
    if L2PF > 0:
        _prefetch_tile(w_ptr, pid, N, K, EPILOGUE, HEAD, BLOCK_N)
    pos = offs_m.to(tl.int64)
    slot = pos
    if EPILOGUE == 2:  # the step's positions and slots, not written by earlier kernels
        pos = tl.load(pos_ptr + offs_m, mask=offs_m < M, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + offs_m, mask=offs_m < M, other=-1).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if CHUNKED:
        if PROLOGUE == 1:  # the RMSNorm's mean square over the whole row, once a program
            ss = tl.zeros([M_PAD], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + k0 + offs_k[None, :],
                             mask=m_ok & (k0 + offs_k[None, :] < K), other=0.0).to(tl.float32)
                ss += tl.sum(xs * xs, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
        x = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
    else:
        x = _prologue(x_ptr, nw_ptr, 0, M, K, eps, stride_xm, rstd, offs_m, offs_k, PROLOGUE, True)
    t0 = pid
    if PRE == 2:  # the first tile's iteration, peeled: the loop's tiles load after the wait, one at a time
        acc_a, acc_b = _tile_dot(wa_n, wb_n, x, offs_m, M_PAD, BLOCK_N // 2)
        _stream_out(pid, acc_a, acc_b, j, offs_m, m_ok, b_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, pos, slot, kv_ptr, N,
                    num_slots, stride_ym, stride_rm, stride_cos, stride_blk, stride_kv, stride_tok, stride_head,
                    scale_ptr, stride_scale, dt, EPILOGUE, HAS_BIAS, BLOCK_N, HEAD, Q_N, KV_N, BS, KV_FP8)
        t0 = pid + nprog
    for t in tl.range(t0, ntiles, nprog, num_stages=STAGES):
        if L2PF > 1:  # the next tile toward L2 while this one loads and its dot runs
            _prefetch_tile(w_ptr, t + nprog, N, K, EPILOGUE, HEAD, BLOCK_N)
        if CHUNKED:  # K in BLOCK_K chunks, the input chunk formed again for each (from L1/L2; RMSNorm's rstd above)
            acc_a = tl.zeros([M_PAD, BLOCK_N // 2], dtype=tl.float32)
            acc_b = tl.zeros([M_PAD, BLOCK_N // 2], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                xk = _prologue(x_ptr, nw_ptr, k0, M, K, eps, stride_xm, rstd, offs_m, offs_k, PROLOGUE, False)
                wa, wb = _stream_tile(w_ptr + k0, t, j, offs_k, k0 + offs_k < K, N, K, EPILOGUE, HEAD, BLOCK_N, EVICT)
                acc_a = _rows_dot(wa, xk, offs_m, acc_a, M_PAD)
                acc_b = _rows_dot(wb, xk, offs_m, acc_b, M_PAD)
        else:
            if PRE == 1:  # this tile was loaded an iteration ago; the next one goes out before its dot
                wa, wb = wa_n, wb_n
                wa_n, wb_n = _stream_tile(w_ptr, t + nprog, j, offs_k, k_ok, N, K, EPILOGUE, HEAD, BLOCK_N, EVICT)
            else:
                wa, wb = _stream_tile(w_ptr, t, j, offs_k, k_ok, N, K, EPILOGUE, HEAD, BLOCK_N, EVICT)
            acc_a, acc_b = _tile_dot(wa, wb, x, offs_m, M_PAD, BLOCK_N // 2)
        _stream_out(t, acc_a, acc_b, j, offs_m, m_ok, b_ptr, y_ptr, res_ptr, cos_ptr, sin_ptr, pos, slot, kv_ptr, N,
                    num_slots, stride_ym, stride_rm, stride_cos, stride_blk, stride_kv, stride_tok, stride_head,
                    scale_ptr, stride_scale, dt, EPILOGUE, HAS_BIAS, BLOCK_N, HEAD, Q_N, KV_N, BS, KV_FP8)

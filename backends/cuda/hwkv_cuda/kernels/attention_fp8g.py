"""Split-KV decode attention over an fp8 (e4m3) KV cache in Gluon: one warp, explicit copy and shared layouts
(issue #36, an A/B route behind ``HWKV_CUDA_FP8G=1``; launch in :mod:`hwkv_cuda.attention_fp8g`).

Why Gluon: Nsight Compute of the Triton kernel (``decode_heads_kernel``, H200, 32 x 32k) found it L2-bound with the
V loads at twice their ideal L2 sectors and the shared-memory stores of V conflicting eight ways - layouts Triton's
passes choose from the pointer shapes, which a Triton kernel cannot steer. Here every layout is written down:

* a program is one warp: one request, ``NH`` KV heads, one split of the keys; its tiles are ``NB`` whole cache
  blocks (``BS`` = 16 keys each), streamed ``STAGES`` deep with ``cp.async`` (one commit group per tile), so the
  only barriers are the warp's own (a tile's arrival; the layout conversions' scratch);
* K: each key's ``NH * D`` bytes of its row (the ``NH`` heads side by side, as stored) land in a ``[keys, NH * D]``
  tile whose 16-byte chunks are XOR-swizzled by row: eight lanes copy one row's 128 contiguous bytes, and the
  8-row ``ldmatrix`` reads of one head's ``[keys, D]`` slice hit eight different banks;
* V: the ``NH`` heads' ``[D, BS]`` pages of a block are ``NH * D`` consecutive 16-byte rows, copied as they are
  into that block's ``[NH * D, BS]`` slot (``cp.async`` coalesces only when both the global and the shared
  addresses of a quarter-warp run on: a ``[NH * D, NB * BS]`` tile with the two blocks side by side fetched
  every sector twice and stored eight ways conflicted, Nsight Compute); ``ldmatrix`` reads 8 consecutive rows of
  one block, 128 contiguous bytes; each block's ``V^T P^T`` is its own K = 16 product;
* per head and block ``S^T = K Q^T`` (keys in the MMA's M, the ``G`` query heads padded to N = 8) and
  ``O^T += V^T P^T``, ``mma.sync`` on fp16: e4m3 codes are exact in fp16 (one ``cvt.rn.f16x2.e4m3x2`` per two),
  the query scaled by 2^-8 into fp16 and the 256 folded into the score scale (as the unified kernel's fp16 dots);
* blocks wholly past a split's end are not read (zero-filled); the keys past the end of a partly used block are
  read and weighted 0 - finite codes, as a cache is zeroed when allocated and written with clamped codes only;
* the softmax runs down M in base 2; the program writes fp32 partials ``(acc, max, sum)`` of every split (the
  unified kernel's layout) and :func:`hwkv_cuda.kernels.attention.reduce_kernel` merges them.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.ampere import mma_v2


@gluon.jit
def _ids(bt_ptr, start, hi, BS: gl.constexpr):
    """The two cache blocks of the tile at ``start`` (block 0 where the block lies wholly past ``hi``)."""
    b = start // BS
    blk0 = gl.load(bt_ptr + b, mask=start < hi, other=0).to(gl.int64)
    blk1 = gl.load(bt_ptr + b + 1, mask=start + BS < hi, other=0).to(gl.int64)
    return blk0, blk1


@gluon.jit
def _issue(k_buf, v_buf0, v_buf1, kv_ptr, blk0, blk1, start, hi, k_base, v_base, stride_blk, stride_kv, stride_tok,
           HD: gl.constexpr, BS: gl.constexpr, KL: gl.constexpr, VL: gl.constexpr):
    """``cp.async`` of one tile (two blocks) into ``k_buf`` ``[2 * BS, HD]`` and each block's ``v_buf`` ``[HD, BS]``;
    a block wholly past ``hi`` is not read (its keys are masked out of the scores)."""
    kr = gl.arange(0, 2 * BS, layout=gl.SliceLayout(1, KL))[:, None]
    kc = gl.arange(0, HD, layout=gl.SliceLayout(0, KL))[None, :]
    second = kr >= BS
    kblk = gl.where(second, blk1, blk0)
    kok = gl.where(second, start + BS < hi, start < hi) & (kc < HD)
    cp.async_copy_global_to_shared(k_buf, kv_ptr + kblk * stride_blk + (kr % BS) * stride_tok + k_base + kc,
                                   mask=kok)
    vr = gl.arange(0, HD, layout=gl.SliceLayout(1, VL))[:, None]
    vc = gl.arange(0, BS, layout=gl.SliceLayout(0, VL))[None, :]
    voff = stride_kv + v_base + vr * BS + vc
    cp.async_copy_global_to_shared(v_buf0, kv_ptr + blk0 * stride_blk + voff, mask=(start < hi) & (vr < HD))
    cp.async_copy_global_to_shared(v_buf1, kv_ptr + blk1 * stride_blk + voff, mask=(start + BS < hi) & (vr < HD))


@gluon.jit
def _head(acc, m_i, l_acc, qt, scale, k_buf, v_buf0, v_buf1, ok0, ok1, h: gl.constexpr, D: gl.constexpr,
          BS: gl.constexpr, MMA: gl.constexpr, A: gl.constexpr, B: gl.constexpr):
    """One tile (two blocks) of one KV head: per block the scores down M, one online-softmax step per query-head
    column over both, per block ``O^T += V^T P^T``. The running sum stays per lane (``l_acc`` ``[BS, 8]``, summed
    down M once after the loop): one cross-lane reduction a tile, the max's."""
    kh = k_buf.slice(h * D, D, dim=1)
    s0 = mma_v2(kh.slice(0, BS, dim=0).load(A).to(gl.float16), qt, gl.zeros([BS, 8], gl.float32, MMA)) * scale
    s1 = mma_v2(kh.slice(BS, BS, dim=0).load(A).to(gl.float16), qt, gl.zeros([BS, 8], gl.float32, MMA)) * scale
    s0 = gl.where(ok0[:, None], s0, float("-inf"))
    s1 = gl.where(ok1[:, None], s1, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(gl.maximum(s0, s1), axis=0))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p0 = gl.exp2(s0 - m_safe[None, :])
    p1 = gl.exp2(s1 - m_safe[None, :])
    alpha = gl.exp2(m_i - m_safe)
    l_acc = l_acc * alpha[None, :] + p0 + p1
    v0 = v_buf0.slice(h * D, D, dim=0).load(A).to(gl.float16)  # [D, BS]: V^T of block 0
    acc = mma_v2(v0, gl.convert_layout(p0.to(gl.float16), B), acc * alpha[None, :])
    v1 = v_buf1.slice(h * D, D, dim=0).load(A).to(gl.float16)
    acc = mma_v2(v1, gl.convert_layout(p1.to(gl.float16), B), acc)
    return acc, m_new, l_acc


@gluon.jit
def _q_head(q_ptr, q_row, head0, G: gl.constexpr, D: gl.constexpr, QL: gl.constexpr, B: gl.constexpr):
    """``Q^T`` ``[D, 8]`` of one KV head's query heads (columns past ``G`` zero), 2^-8 times itself in fp16."""
    d = gl.arange(0, D, layout=gl.SliceLayout(1, QL))[:, None]
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, QL))[None, :]
    q = gl.load(q_ptr + q_row + (head0 + g) * D + d, mask=(g < G) & (d < D), other=0.0)
    return gl.convert_layout((q.to(gl.float32) * 0.00390625).to(gl.float16), B)


@gluon.jit
def _store_part(part_acc_ptr, part_ml_ptr, acc, m_i, l_acc, v_scale, row0, split, G: gl.constexpr, D: gl.constexpr,
                NUM_SPLITS_PAD: gl.constexpr, MMA: gl.constexpr):
    """The split's fp32 partials of one KV head's ``G`` query heads (rows ``row0 + g``), as the unified kernel's."""
    d = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))[:, None]
    g = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    prow = (row0 + g) * NUM_SPLITS_PAD + split
    l_i = gl.sum(l_acc, axis=0)
    gl.store(part_acc_ptr + prow[None, :] * D + d, acc * v_scale, mask=(g[None, :] < G) & (d < D))
    gl.store(part_ml_ptr + prow * 2, m_i, mask=g < G)
    gl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=g < G)


@gluon.jit
def fp8g_decode_kernel(q_ptr, kv_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, block_tables_ptr, kv_scale_ptr,
                       min_seg, qk_scale, stride_scale, stride_qt, stride_blk, stride_kv, stride_tok, stride_bt,
                       HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr,
                       NUM_SPLITS_PAD: gl.constexpr):
    """Grid ``(requests, H_kv / 2, splits)``, one warp each; two KV heads a program, tiles of two blocks (module doc).
    The query is ``[tokens, H, D]`` with unit strides inside a token; ``seq_lens`` and the block tables as the
    unified kernel's; ``min_seg`` and the split rounding as :meth:`CudaAttentionMetadata.plan`'s."""
    NH: gl.constexpr = 2
    NB: gl.constexpr = 2
    BN: gl.constexpr = NB * BS
    HD: gl.constexpr = NH * D
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
    KL: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // HD, HD // 16], [1, 1], [1, 0])
    VL: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [1, 1], [1, 0])
    QL: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 1], [0, 1])
    KS: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=HD // 16, order=[1, 0])
    VS: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])

    seq = gl.program_id(0)
    hp = gl.program_id(1)
    split = gl.program_id(2)
    nsplit = gl.num_programs(2)
    seq_len = gl.load(seq_lens_ptr + seq)
    seg = (seq_len + nsplit - 1) // nsplit
    seg = gl.maximum((seg + BN - 1) // BN * BN, min_seg)
    lo = split * seg
    hi = gl.minimum(lo + seg, seq_len)
    n_tiles = (gl.maximum(hi - lo, 0) + BN - 1) // BN
    bt_ptr = block_tables_ptr + seq.to(gl.int64) * stride_bt
    k_base = hp * HD
    v_base = hp * (HD * BS)

    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, HD], KS)
    v_smem0 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HD, BS], VS)  # the tile's first block
    v_smem1 = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, HD, BS], VS)
    for t in gl.static_range(STAGES - 1):
        start = lo + t * BN
        blk0, blk1 = _ids(bt_ptr, start, hi, BS)
        _issue(k_smem.index(t), v_smem0.index(t), v_smem1.index(t), kv_ptr, blk0, blk1, start, hi, k_base, v_base,
               stride_blk, stride_kv, stride_tok, HD, BS, KL, VL)
        cp.commit_group()
    nxt0, nxt1 = _ids(bt_ptr, lo + (STAGES - 1) * BN, hi, BS)

    q_row = seq.to(gl.int64) * stride_qt
    kvh0 = hp * NH
    qt0 = _q_head(q_ptr, q_row, kvh0 * G, G, D, QL, B)
    qt1 = _q_head(q_ptr, q_row, (kvh0 + 1) * G, G, D, QL, B)
    scale0 = qk_scale * 256.0 * gl.load(kv_scale_ptr + kvh0)
    scale1 = qk_scale * 256.0 * gl.load(kv_scale_ptr + kvh0 + 1)
    m0 = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    m1 = gl.full([8], float("-inf"), gl.float32, gl.SliceLayout(0, MMA))
    l0 = gl.zeros([BS, 8], gl.float32, MMA)
    l1 = gl.zeros([BS, 8], gl.float32, MMA)
    acc0 = gl.zeros([D, 8], gl.float32, MMA)
    acc1 = gl.zeros([D, 8], gl.float32, MMA)
    keys = gl.arange(0, BS, layout=gl.SliceLayout(1, MMA))
    for i in range(n_tiles):
        cp.wait_group(STAGES - 2)  # tile i has landed (this lane's copies) ...
        gl.thread_barrier()  # ... every lane's, and every lane is done with tile i - 1's slot, refilled next
        t_next = i + STAGES - 1
        start_n = lo + t_next * BN
        slot_n = t_next % STAGES
        _issue(k_smem.index(slot_n), v_smem0.index(slot_n), v_smem1.index(slot_n), kv_ptr, nxt0, nxt1, start_n, hi,
               k_base, v_base, stride_blk, stride_kv, stride_tok, HD, BS, KL, VL)
        cp.commit_group()
        nxt0, nxt1 = _ids(bt_ptr, start_n + BN, hi, BS)
        slot = i % STAGES
        kb = k_smem.index(slot)
        ok0 = lo + i * BN + keys < hi
        ok1 = lo + i * BN + BS + keys < hi
        vb0 = v_smem0.index(slot)
        vb1 = v_smem1.index(slot)
        acc0, m0, l0 = _head(acc0, m0, l0, qt0, scale0, kb, vb0, vb1, ok0, ok1, 0, D, BS, MMA, A, B)
        acc1, m1, l1 = _head(acc1, m1, l1, qt1, scale1, kb, vb0, vb1, ok0, ok1, 1, D, BS, MMA, A, B)
    cp.wait_group(0)

    row0 = seq.to(gl.int64) * (HKV * G) + kvh0 * G
    _store_part(part_acc_ptr, part_ml_ptr, acc0, m0, l0, gl.load(kv_scale_ptr + stride_scale + kvh0), row0, split,
                G, D, NUM_SPLITS_PAD, MMA)
    _store_part(part_acc_ptr, part_ml_ptr, acc1, m1, l1, gl.load(kv_scale_ptr + stride_scale + kvh0 + 1), row0 + G,
                split, G, D, NUM_SPLITS_PAD, MMA)

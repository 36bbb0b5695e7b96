"""fp8 decode probe: a pure-decode split-KV kernel with the block ids and K/V tiles prefetched one tile ahead in
registers (no dependent block-table load before each tile's copy; the in-tree form is the tile field prefetch=1),
against the current impl, both caches, one run. Device: python3 backends/cuda/scripts/fp8_prefetch_probe.py B CTX D OUT
"""
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl
from hwkv_cuda.attention import CudaMetadataBuilder, TritonAttentionBackend
from hwkv_cuda.bench.attention import _time, copy_bandwidth
from hwkv_cuda.kernels.attention import reduce_kernel
from hwkv_cuda.tiles import OVERRIDE_ENV

from hwkv.interfaces.attention import AttentionMetadata
from hwkv.interfaces.kv_quant import FP8_E4M3


@triton.jit
def decode_kernel(q_ptr, kv_ptr, part_acc_ptr, part_ml_ptr, seq_lens_ptr, bt_ptr0, kv_scale_ptr, qk_scale,
                  stride_scale, stride_qt, stride_qh, stride_blk, stride_kv, stride_tok, stride_head, stride_bt,
                  G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, NSP: tl.constexpr, KV_FP8: tl.constexpr, HM: tl.constexpr):
    if HM:
        kvh = tl.program_id(0)
        split = tl.program_id(1)
        nsplit = tl.num_programs(1)
    else:
        split = tl.program_id(0)
        kvh = tl.program_id(1)
        nsplit = tl.num_programs(0)
    seq = tl.program_id(2)
    n_kvh = tl.num_programs(0) if HM else tl.num_programs(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    seg = (seq_len + nsplit - 1) // nsplit
    seg = (seg + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * seg
    hi = tl.minimum(lo + seg, seq_len)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < G
    head = kvh * G + offs_m
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    v_scale = 1.0
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr + kvh) * 256.0
        v_scale = tl.load(kv_scale_ptr + stride_scale + kvh)
        q = (q.to(tl.float32) * 0.00390625).to(tl.float16)
    bt = bt_ptr0 + seq.to(tl.int64) * stride_bt
    kvh_off = kvh.to(tl.int64) * stride_head
    kv_v = kv_ptr + stride_kv
    # prologue: tile 0's ids and K/V, tile 1's ids
    pos = lo + offs_n
    nm = pos < hi
    blk = tl.load(bt + pos // BS, mask=nm, other=0).to(tl.int64)
    off = blk * stride_blk + (pos % BS) * stride_tok + kvh_off
    k = tl.load(kv_ptr + off[:, None] + offs_d[None, :], mask=nm[:, None], other=0.0)
    v = tl.load(kv_v + off[:, None] + offs_d[None, :], mask=nm[:, None], other=0.0)
    pos1 = pos + BLOCK_N
    nm1 = pos1 < hi
    blk1 = tl.load(bt + pos1 // BS, mask=nm1, other=0).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    for _i in range(n_tiles):
        # next tile's copy from ids loaded one iteration ago; the tile after's ids
        off1 = blk1 * stride_blk + (pos1 % BS) * stride_tok + kvh_off
        k1 = tl.load(kv_ptr + off1[:, None] + offs_d[None, :], mask=nm1[:, None], other=0.0)
        v1 = tl.load(kv_v + off1[:, None] + offs_d[None, :], mask=nm1[:, None], other=0.0)
        pos2 = pos1 + BLOCK_N
        nm2 = pos2 < hi
        blk2 = tl.load(bt + pos2 // BS, mask=nm2, other=0).to(tl.int64)
        if KV_FP8:
            kk = k.to(tl.float16)
            vv = tl.where(offs_d[None, :] < D, v.to(tl.float16), 0.0)
        else:
            kk = k
            vv = v
        qk = tl.dot(q, tl.trans(kk)) * qk_scale
        qk = tl.where(nm[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
        m_i = m_new
        k = k1
        v = v1
        nm = nm1
        pos1 = pos2
        nm1 = nm2
        blk1 = blk2
    acc = acc * v_scale
    row = (seq.to(tl.int64) * (G * n_kvh) + head) * NSP + split
    tl.store(part_acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)


def launcher(q, kv, tables, seq_lens, scales, out, splits, block_n, warps, hm, stages=1):
    b, h, d = q.shape
    hkv = kv.shape[3]
    bs = kv.shape[2]
    g = h // hkv
    nsp = triton.next_power_of_2(splits)
    pa = torch.empty(b * h * nsp * d, dtype=torch.float32, device=q.device)
    pm = torch.empty(b * h * nsp * 2, dtype=torch.float32, device=q.device)
    fp8 = kv.dtype == FP8_E4M3
    grid = (hkv, splits, b) if hm else (splits, hkv, b)

    def run():
        decode_kernel[grid](q, kv, pa, pm, seq_lens, tables, scales, d**-0.5 * 1.4426950408889634,
                            scales.stride(0), q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
                            kv.stride(3), tables.stride(0), G=g, D=d, BS=bs,
                            BLOCK_M=max(16, triton.next_power_of_2(g)),
                            BLOCK_N=block_n, NSP=nsp, KV_FP8=fp8, HM=hm, num_warps=warps, num_stages=stages)
        reduce_kernel[(b, h)](out, pa, pm, out.stride(0), out.stride(1), h, splits, HEAD_SIZE=d, D_PAD=d,
                              NUM_SPLITS_PAD=nsp)
    return run


def main():
    b, ctx, h, hkv, d, bs = int(sys.argv[1]), int(sys.argv[2]), 32, 8, int(sys.argv[3]), 16
    outp = sys.argv[4]
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    res = dict(device=torch.cuda.get_device_name(), shape=[b, ctx, h, hkv, d], copy_bw_TBps=bw / 1e12,
               date=time.strftime("%Y-%m-%d %H:%M UTC"), rows=[])
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    nblk = -(-ctx // bs)
    tables = torch.randperm(b * nblk, device=dev).to(torch.int32).view(b, nblk)
    md = AttentionMetadata.build([1] * b, [ctx] * b, tables, bs, device=dev)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, h, d, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    base = torch.randn(b * nblk, 2, bs, hkv, d, dtype=q.dtype, device=dev)
    caches = {"bf16": base, "fp8": (base * 8).to(FP8_E4M3)}
    del base
    scales = torch.full((2, hkv), 0.125, device=dev)
    refs = {}
    def row(**r):
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
        with open(outp, "w") as f:
            json.dump(res, f, indent=1)
    for name, kv in caches.items():
        nbytes = kv.numel() * kv.element_size()
        best = "fp8_unpack=7,block_n=128,num_stages=5,head_major=1" if name == "fp8" else "num_stages=5,head_major=1"
        for variant in ["default", best]:
            os.environ.pop(OVERRIDE_ENV, None)
            if variant != "default":
                os.environ[OVERRIDE_ENV] = variant
            try:
                impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
                impl.kv_scales = scales
                built = CudaMetadataBuilder().build(md)
                fn = lambda i=impl, k=kv, m=built: i.forward_into(out, q, k, m)
                t = _time([fn], 15)
                if variant == "default":
                    refs[name] = out.float().clone()
                err = ((out.float() - refs[name]).norm() / refs[name].norm()).item()
                row(kv=name, kernel="impl", variant=variant, us=t * 1e6, TBps=nbytes / t / 1e12, frac=nbytes / t / bw,
                    err=err)
            except Exception as e:
                row(kv=name, kernel="impl", variant=variant, error=repr(e)[:300])
        os.environ.pop(OVERRIDE_ENV, None)
        for splits in (4, 8, 16):
            for block_n in (64, 128):
                for warps in (4,):
                    for hm in (1, 0):
                        if hm == 0 and not (splits == 8 and block_n == 128):
                            continue
                        try:
                            fn = launcher(q, kv, tables, seq_lens, scales, out, splits, block_n, warps, hm)
                            t = _time([fn], 15)
                            err = ((out.float() - refs[name]).norm() / refs[name].norm()).item()
                            row(kv=name, kernel="prefetch", splits=splits, block_n=block_n, warps=warps, hm=hm,
                                us=t * 1e6, TBps=nbytes / t / 1e12, frac=nbytes / t / bw, err=err)
                        except Exception as e:
                            row(kv=name, kernel="prefetch", splits=splits, block_n=block_n, warps=warps, hm=hm,
                                error=repr(e)[:300])
        for warps, bn, sp in ((8, 128, 8), (2, 64, 16), (4, 256, 8)):
            try:
                fn = launcher(q, kv, tables, seq_lens, scales, out, sp, bn, warps, 1)
                t = _time([fn], 15)
                err = ((out.float() - refs[name]).norm() / refs[name].norm()).item()
                row(kv=name, kernel="prefetch", splits=sp, block_n=bn, warps=warps, hm=1, us=t * 1e6,
                    TBps=nbytes / t / 1e12, frac=nbytes / t / bw, err=err)
            except Exception as e:
                row(kv=name, kernel="prefetch", splits=sp, block_n=bn, warps=warps, hm=1, error=repr(e)[:300])


if __name__ == "__main__":
    main()

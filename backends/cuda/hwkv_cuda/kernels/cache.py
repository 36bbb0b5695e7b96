"""KV-cache kernels (Triton): ``write_kv`` (reshape-and-cache by slot mapping) and a batched block
copy that also reaches pinned host memory through unified addressing (one launch per tensor)."""

import triton
import triton.language as tl

try:  # Hopper's grid dependency control (as kernels/dense.py, which imports this module)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - PDL is then reported unavailable (hwkv_cuda.launch)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def to_e4m3_grid(x):
    """fp32 ``x`` (already divided by its scale) saturated to +-448 and rounded to nearest-even onto the
    float8 e4m3 grid, still as fp32, so the final cast is exact. Done by hand because the Triton
    interpreter's fp32 -> fp8 cast loses the carry at the top of a binade (0.48 -> 0.25): one code
    path, checked on the CPU, runs on the GPU too (a few ALU ops per element of a memory-bound store).
    Spacing: 2^(e - 3) for exponent e >= -6, the subnormal 2^-9 below; RNE by the 1.5 * 2^23 trick
    (|x / spacing| <= 16); zeros keep their sign, as torch's cast does."""
    x = tl.clamp(x, -448.0, 448.0)
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6) - 3
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    r = (x * inv + 12582912.0) - 12582912.0
    return tl.where(r == 0.0, x * 0.0, r * ulp)


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, kv_ptr, slot_ptr, num_slots,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_blk, stride_kv, stride_tok, stride_head,
                    H_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                    BS: tl.constexpr, scale_ptr=None, stride_scale=0, KV_FP8: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    if PDL:  # launched during the previous kernel's tail: the next PDL kernel may launch; wait before any read
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int32 slot maps too: offsets past 2^31 elements
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    # -1 is padding; anything outside [0, num_slots) is a caller bug, skipped the same way so that a
    # bad slot can never write past the cache (the host check, when enabled, names it)
    slots = offs_h[:, None] * 0 + slot
    valid = (slots >= 0) & (slots < num_slots)
    mask = (offs_h[:, None] < H_KV) & (offs_d[None, :] < HEAD_SIZE) & valid
    blk = tl.maximum(slot, 0) // BS
    dst = kv_ptr + blk * stride_blk + (tl.maximum(slot, 0) % BS) * stride_tok \
        + offs_h[:, None] * stride_head + offs_d[None, :]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:  # hwkv.interfaces.kv_quant.quantize: IEEE fp32 division by the head's scale, saturated, RNE
        h_ok = offs_h < H_KV
        ks = tl.load(scale_ptr + offs_h, mask=h_ok, other=1.0)[:, None]
        vs = tl.load(scale_ptr + stride_scale + offs_h, mask=h_ok, other=1.0)[:, None]
        k = to_e4m3_grid(tl.fdiv(k.to(tl.float32), ks, ieee_rounding=True))
        v = to_e4m3_grid(tl.fdiv(v.to(tl.float32), vs, ieee_rounding=True))
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
    if KV_FP8:  # V pages stored [H_kv, D, BS] (hwkv.interfaces.kv_quant): keys contiguous per head and dim
        dst = kv_ptr + blk * stride_blk + stride_kv + tl.maximum(slot, 0) % BS \
            + offs_h[:, None] * (stride_head * BS) + offs_d[None, :] * BS
        tl.store(dst, v.to(kv_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + stride_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def copy_blocks_kernel(src_ptr, dst_ptr, pairs_ptr, block_elems, CHUNK: tl.constexpr):
    """Copy block ``pairs[i, 0]`` of ``src`` to block ``pairs[i, 1]`` of ``dst``; grid (pairs, chunks)."""
    i = tl.program_id(0)
    c = tl.program_id(1)
    s = tl.load(pairs_ptr + 2 * i).to(tl.int64)
    d = tl.load(pairs_ptr + 2 * i + 1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    x = tl.load(src_ptr + s * block_elems + offs, mask=mask)
    tl.store(dst_ptr + d * block_elems + offs, x, mask=mask)


@triton.jit
def copy_blocks_tensors_kernel(src_ptr, dst_ptr, offs_ptr, pairs_ptr, block_elems,
                               CHUNK: tl.constexpr, PER_16: tl.constexpr):
    """:func:`copy_blocks_kernel` for every KV tensor of a cache in one launch; grid (pairs, tensors,
    chunks). Tensor ``t`` starts ``offs[2t]`` (source) / ``offs[2t + 1]`` (destination) 16-byte units
    from ``src_ptr`` / ``dst_ptr`` (the first tensors: any tensor's address would do, but an offset in
    16-byte units keeps the loads vectorised, as a loaded pointer would not), ``PER_16`` elements each."""
    i = tl.program_id(0)
    t = tl.program_id(1)
    c = tl.program_id(2)
    s = tl.load(pairs_ptr + 2 * i).to(tl.int64)
    d = tl.load(pairs_ptr + 2 * i + 1).to(tl.int64)
    so = tl.load(offs_ptr + 2 * t) * PER_16
    do = tl.load(offs_ptr + 2 * t + 1) * PER_16
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    x = tl.load(src_ptr + so + s * block_elems + offs, mask=mask)
    tl.store(dst_ptr + do + d * block_elems + offs, x, mask=mask)

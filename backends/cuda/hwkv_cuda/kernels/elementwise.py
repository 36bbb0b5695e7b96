"""Elementwise kernels (Triton) of a forward of many tokens: RMSNorm (with the residual add), neox RoPE
and SiLU·mul, each one launch that reads and writes every byte once.

They compute the model's torch ops (hwkv/model/layers.py, rope.py) and round to the activation dtype
wherever those ops round, as the decode GEMVs do (:mod:`hwkv_cuda.kernels.dense`); only ``rsqrt`` and
``exp`` may differ in their last bit from torch's.
"""

import triton
import triton.language as tl

from hwkv_cuda.kernels.dense import gdc_launch_dependents, gdc_wait


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Launched with programmatic dependent launch (``PDL``): let the next PDL kernel launch now (it waits for this
    one's completion before reading anything), then wait for the previous kernel's writes before reading them."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, N, eps, stride_x, stride_r, stride_y, stride_h,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row: ``h = x + r`` (rounded; stored) when ``HAS_RES``, then ``w * (h.float() * rsqrt(mean(h^2) +
    eps)).to(dtype)`` (both products rounded)."""
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_RES:
        r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(h_ptr + row * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    xn = (xf * rstd).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (w * xn).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, stride_y, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``silu(x[:, :inter]) * x[:, inter:]``, the SiLU rounded, then the product."""
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < inter
    g = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + inter + col, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    tl.store(y_ptr + row * stride_y + col, (s * u.to(tl.float32)).to(dt), mask=mask)


@triton.jit
def _rope_block(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, heads, stride_xt, stride_xh, stride_cos, t, blk,
                HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    hb = blk * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, HALF_PAD)
    im = i < HALF
    m = (hb < heads)[:, None] & im[None, :]
    pos = tl.load(pos_ptr + t).to(tl.int64)
    crow = cos_ptr + pos * stride_cos
    srow = sin_ptr + pos * stride_cos
    c1 = tl.load(crow + i, mask=im, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(crow + HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(srow + i, mask=im, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(srow + HALF + i, mask=im, other=0.0).to(tl.float32)[None, :]
    src = x_ptr + t * stride_xt + hb[:, None].to(tl.int64) * stride_xh + i[None, :]
    a = tl.load(src, mask=m, other=0.0)
    dt = a.dtype
    af = a.to(tl.float32)
    bf = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    o1 = ((af * c1).to(dt).to(tl.float32) + (-bf * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((bf * c2).to(dt).to(tl.float32) + (af * s2).to(dt).to(tl.float32)).to(dt)
    dst = out_ptr + (t * heads + hb[:, None].to(tl.int64)) * (2 * HALF) + i[None, :]
    tl.store(dst, o1, mask=m)
    tl.store(dst + HALF, o2, mask=m)


@triton.jit
def rope_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, heads, stride_xt, stride_xh, stride_cos,
                HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """``BLOCK_H`` heads of one token: ``x * c + rotate_half(x) * s`` with ``c, s`` the rows of ``positions``,
    each product rounded, then the sum; out is ``[T, heads, 2 * HALF]`` contiguous."""
    _pdl_start(PDL)
    _rope_block(x_ptr, out_ptr, cos_ptr, sin_ptr, pos_ptr, heads, stride_xt, stride_xh, stride_cos,
                tl.program_id(0).to(tl.int64), tl.program_id(1), HALF, HALF_PAD, BLOCK_H)


@triton.jit
def rope_qk_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, q_heads, k_heads, q_blocks, stride_qt,
                   stride_qh, stride_kt, stride_kh, stride_cos, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """:func:`rope_kernel` of q and k in one launch (the same values): head blocks ``< q_blocks`` of a token are q's,
    the rest k's - one launch less per layer, which at a decode batch is ~1.5-2 µs of a launch that moves ~1 MB."""
    _pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    if blk < q_blocks:
        _rope_block(q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, q_heads, stride_qt, stride_qh, stride_cos, t, blk,
                    HALF, HALF_PAD, BLOCK_H)
    else:
        _rope_block(k_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr, k_heads, stride_kt, stride_kh, stride_cos, t,
                    blk - q_blocks, HALF, HALF_PAD, BLOCK_H)

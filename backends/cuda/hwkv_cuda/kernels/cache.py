"""KV-cache kernels (Triton): ``write_kv`` (reshape-and-cache by slot mapping) and a batched block
copy that also reaches pinned host memory through unified addressing (one launch per tensor)."""

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, kv_ptr, slot_ptr, num_slots,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_blk, stride_kv, stride_tok, stride_head,
                    H_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                    BS: tl.constexpr):
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
    tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
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

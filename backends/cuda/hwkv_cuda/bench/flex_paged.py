"""FlexAttention reading hwkv's paged KV cache in place: the bench's ``flex-paged`` peer.

Built the way paged FlexAttention is used (torch's experimental ``PagedAttention``, vLLM's
FlexAttention backend): the cache is one flat KV sequence shared by the batch, each request gets a
block mask that lists its own pages (block size = page size), and a ``mask_mod`` maps a physical
index back to the request's logical position for the partial pages (causal edge, ragged end).

hwkv's PER_LAYER cache ``[nb, 2, bs, H_kv, D]`` interleaves a block's K and V, so the flat sequence is
the whole cache as ``[1, H_kv, nb * 2 * bs, D]`` (a view, no copy): K is that view, V the same view
shifted by ``bs``, so index ``2 * p * bs + o`` reads K and V of page ``p``, offset ``o``. Only even
blocks (K halves) are ever listed in the mask.
"""

from __future__ import annotations

from typing import Any

Q_BLOCK = 16  # query rows per mask block, as vLLM's direct build
MAX_ELEMENTS = 2**31  # an H100 run hit an illegal address with K/V views beyond this (32-bit offsets)


def paged_flex_args(kv: Any, block_table: Any, q_len: int, seq_len: int) -> dict:
    """Inputs for ``flex_attention(q, k, v, block_mask=..., kernel_options=..., enable_gqa=...)`` with
    ``q`` of shape ``[B, H, q_len, D]`` (request ``b``'s tokens at logical positions
    ``seq_len - q_len ...``), over ``kv`` ``[nb, 2, bs, H_kv, D]`` and ``block_table``
    ``[B, >= ceil(seq_len / bs)]``; every request has the same ``q_len`` and ``seq_len`` (the bench's
    shapes). The ``mask_mod`` closes over this table's inverse, so a compiled FlexAttention is
    specialised to one table: the bench times one input set with it."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    nb, two, bs, hkv, d = kv.shape
    if two != 2 or not kv.is_contiguous():
        raise ValueError("kv must be a contiguous [num_blocks, 2, block_size, H_kv, D] cache")
    batch, dev = block_table.shape[0], kv.device
    prefix = seq_len - q_len
    pages = -(-seq_len // bs)
    table = block_table[:, :pages].to(torch.int64)
    flat = kv.view(nb * 2 * bs, hkv, d).permute(1, 0, 2).unsqueeze(0)
    k, v = flat[:, :, : (2 * nb - 1) * bs], flat[:, :, bs:]
    if k.numel() >= MAX_ELEMENTS:
        raise ValueError(f"K/V views of {k.numel()} elements: FlexAttention's kernel faults beyond 2^31 "
                         "(illegal address on an H100 at batch 256, ctx 8k, GQA 32/8)")

    # per query block: pages every row sees whole (full) and pages that need the mask (partial)
    nq = -(-q_len // Q_BLOCK)
    qb = torch.arange(nq, device=dev)
    first = prefix + qb * Q_BLOCK
    last = prefix + torch.clamp((qb + 1) * Q_BLOCK, max=q_len) - 1
    n_full = torch.clamp((first + 1) // bs, max=seq_len // bs)
    n_vis = last // bs + 1
    j = torch.arange(pages, device=dev)
    phys = 2 * table  # flat block index of each logical page's K half

    def pack(lo, hi):  # pages [lo, hi) of every query block, left-packed, as flat block indices
        keep = (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])  # [nq, pages]
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
        idx = torch.gather(phys[:, None, :].expand(batch, nq, pages), 2, order[None].expand(batch, nq, pages))
        num = keep.sum(1).to(torch.int32)[None].expand(batch, nq)
        return num[:, None].contiguous(), idx[:, None].to(torch.int32).contiguous()

    inv = torch.full((batch, nb), -1, dtype=torch.int64, device=dev)  # request b's logical page of a page
    inv.scatter_(1, table, j[None].expand(batch, pages).contiguous())

    def mask_mod(b, h, q_idx, kv_idx):
        blk = kv_idx // bs
        page = inv[b, blk // 2]
        pos = page * bs + kv_idx % bs
        return (blk % 2 == 0) & (page >= 0) & (pos <= prefix + q_idx) & (pos < seq_len)

    part_num, part_idx = pack(n_full, n_vis)
    full_num, full_idx = pack(torch.zeros_like(n_full), n_full)
    mask = BlockMask.from_kv_blocks(part_num, part_idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, bs),
                                    mask_mod=mask_mod, seq_lengths=(q_len, k.shape[2]), compute_q_blocks=False)
    # vLLM's kernel options for a direct-built paged mask: the kernel's tiles are the mask's blocks
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK, "BLOCK_N": bs}
    return dict(k=k, v=v, block_mask=mask, kernel_options=options)

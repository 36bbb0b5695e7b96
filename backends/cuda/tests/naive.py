"""An independent naive paged attention (float64, per request, explicit gather and causal mask), on
whatever device its inputs live: the CPU tests and ``scripts/gpu_check.py`` share it."""

import torch


def naive_attention(q, kv, query_lens, seq_lens, block_tables, scale, window=None, softcap=None, sinks=None):
    """q [T, H, D]; kv [nb, 2, bs, Hkv, D]; per-request loop over dense gathered K/V. ``window``: keys in
    ``(p - window, p]``; ``softcap``: ``c * tanh(s / c)``; ``sinks`` ``[H]``: one more logit per head
    in the denominator (the interface's definitions)."""
    dev = q.device
    out = torch.empty(q.shape, dtype=torch.float64, device=dev)
    bs, hkv = kv.shape[2], kv.shape[3]
    g = q.shape[1] // hkv
    t0 = 0
    for ql, sl, bt in zip(query_lens, seq_lens, block_tables):
        ql, sl = int(ql), int(sl)
        lo = 0 if window is None else max(0, sl - ql - window + 1)  # keys no query row sees are not read
        pos = torch.arange(lo, sl, device=dev)
        blk = torch.as_tensor(bt, device=dev)[pos // bs].long()
        k = kv[blk, 0, pos % bs].double().repeat_interleave(g, dim=1)  # [sl, H, D]
        v = kv[blk, 1, pos % bs].double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[t0:t0 + ql].double(), k) * scale
        qpos = torch.arange(sl - ql, sl, device=dev)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        hidden = pos[None, None, :] > qpos[None, :, None]
        if window is not None:
            hidden = hidden | (pos[None, None, :] <= qpos[None, :, None] - window)
        s = s.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double().to(dev)[:, None, None].expand(-1, ql, 1)], -1)
            out[t0:t0 + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1)[..., :-1], v)
        else:
            out[t0:t0 + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        t0 += ql
    return out


def paged_case(qlens, slens, heads, kv_heads, head_size, bs, seed, device="cpu"):
    """fp32 ``q``, a cache of randomly scattered blocks, core metadata on ``device``, the block tables."""
    from hwkv.interfaces.attention import AttentionMetadata
    from hwkv.testing.paged import random_block_tables

    g = torch.Generator().manual_seed(seed)
    tables, nb = random_block_tables(slens, bs, g)
    kv = torch.randn(nb, 2, bs, kv_heads, head_size, generator=g)
    q = torch.randn(sum(qlens), heads, head_size, generator=g)
    md = AttentionMetadata.build(qlens, slens, tables, bs, device=device)
    return q, kv, md, tables

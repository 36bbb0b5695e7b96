"""An independent naive paged attention (float64, per request, explicit gather and causal mask)."""

import torch


def naive_attention(q, kv, query_lens, seq_lens, block_tables, scale):
    """q [T, H, D]; kv [nb, 2, bs, Hkv, D]; per-request loop over dense gathered K/V."""
    out = torch.empty(q.shape, dtype=torch.float64)
    bs, hkv = kv.shape[2], kv.shape[3]
    g = q.shape[1] // hkv
    t0 = 0
    for ql, sl, bt in zip(query_lens, seq_lens, block_tables):
        pos = torch.arange(sl)
        slots = torch.as_tensor(bt)[pos // bs] * bs + pos % bs
        flat = kv.double().transpose(1, 2).reshape(-1, 2, hkv, kv.shape[-1])  # [slot, K/V, Hkv, D]
        k, v = flat[slots, 0], flat[slots, 1]  # [sl, Hkv, D]
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        qq = q[t0:t0 + ql].double()
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        qpos = torch.arange(sl - ql, sl)
        s = s.masked_fill(pos[None, None, :] > qpos[None, :, None], float("-inf"))
        out[t0:t0 + ql] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        t0 += ql
    return out

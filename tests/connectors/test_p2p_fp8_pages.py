"""p2p segments over fp8 caches, whose V pages are stored ``[H_kv, D, block_size]``
(:mod:`hwkv.interfaces.kv_quant`): K moves by token runs, each V page moves whole, once, with the run
holding its last token of the load; every token of the load arrives, in every layout and head slice."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from hwkv.connectors.p2p.protocol import incompatibility, layout_of, pair_segments
from hwkv.interfaces.kv_quant import FP8_E4M3, v_token_view
from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind

from .conftest import move_head_slices


def _cache(layout: KVLayoutKind, heads: int, bs: int = 4, blocks: int = 12, fill: bool = False) -> KVCache:
    kv = KVCache.allocate(KVCacheSpec(3, blocks, bs, heads, 4, FP8_E4M3), layout)
    if fill:
        g = torch.Generator().manual_seed(7)
        for t in kv.tensors:
            t.view(torch.uint8).copy_(torch.randint(0, 0x7E, t.shape, generator=g, dtype=torch.uint8))
    return kv


def _tokens(kv: KVCache, layer: int, blocks: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V codes ``[n, H, D]`` (uint8) of a request's first ``n`` tokens, V through its token view."""
    lk = kv.layer(layer)
    k, v = lk if isinstance(lk, tuple) else (lk[:, 0], lk[:, 1])
    idx = torch.tensor(blocks)
    flat = lambda t: t[idx].reshape(-1, *t.shape[2:])[:n].view(torch.uint8)  # noqa: E731
    return flat(k), flat(v_token_view(v))


def test_fp8_format_key_names_the_page_layout():
    kv = _cache(KVLayoutKind.PER_LAYER, 2)
    assert "-vt-" in kv.format_key()
    a = layout_of(kv, "p", "x", "tcp")
    b = layout_of(_cache(KVLayoutKind.PER_LAYER, 2, bs=8), "d", "y", "tcp")
    assert "block sizes differ" in incompatibility(a, b)  # whole V pages need equal block sizes


@pytest.mark.parametrize("src_l, dst_l", list(itertools.product(KVLayoutKind, KVLayoutKind)))
@pytest.mark.parametrize("runs", [[(8, 19)], [(8, 10), (10, 13), (13, 19)], [(0, 3), (3, 19)]])
def test_runs_move_every_token_and_each_v_page_once(src_l, dst_l, runs):
    src, dst = _cache(src_l, 2, fill=True), _cache(dst_l, 2, blocks=24)
    start, n, bs = runs[0][0], runs[-1][1], 4
    sb, db = [5, 6, 7, 1, 2, 9], [3, 4, 10, 11, 12, 20]
    a, b = layout_of(src, "p", "x", "tcp"), layout_of(dst, "d", "y", "tcp")
    assert incompatibility(a, b) == ""
    moved_v = 0
    for lo, hi in runs:  # a load in parts / chunked layerwise writes: the whole load ends at n
        sp, dp, ln = pair_segments(a, b, sb, db, lo, hi, last=n)
        for s, d, k in zip(sp, dp, ln):
            ctypes.memmove(d, s, k)
        moved_v += sum(ln) - 3 * (hi - lo) * 2 * 4  # K bytes: 3 layers x tokens x 2 heads x 4 dims
    assert moved_v == 3 * (-(-n // bs) - start // bs) * bs * 2 * 4  # each touched V page once
    for layer in range(3):
        (ks, vs), (kd, vd) = _tokens(src, layer, sb, n), _tokens(dst, layer, db, n)
        assert torch.equal(ks[start:], kd[start:]) and torch.equal(vs[start:], vd[start:])
        assert not kd[:start].any()  # K outside the range untouched


@pytest.mark.parametrize("total_heads, p_tp, d_tp", [(4, 2, 1), (4, 1, 2), (2, 1, 2)])
def test_head_slices_move_v_pages_per_head(total_heads, p_tp, d_tp):
    from hwkv.parallel.kv_mapping import kv_heads_of

    n = 11
    full = _cache(KVLayoutKind.PER_LAYER, total_heads, fill=True)
    prod = [_cache(KVLayoutKind.PER_LAYER, len(kv_heads_of(total_heads, p_tp, r))) for r in range(p_tp)]
    cons = [_cache(KVLayoutKind.SEPARATE_KV, len(kv_heads_of(total_heads, d_tp, r))) for r in range(d_tp)]
    for r, c in enumerate(prod):  # each producer rank holds its heads of the global KV, V pages per head
        hs = kv_heads_of(total_heads, p_tp, r)
        for layer in range(3):
            mine, glob = c.layer(layer), full.layer(layer)
            mine[:, 0].copy_(glob[:, 0, :, hs.start:hs.stop])
            v_token_view(mine[:, 1]).view(torch.uint8).copy_(
                v_token_view(glob[:, 1])[:, :, hs.start:hs.stop].view(torch.uint8))
    sb, db = [3, 4, 0], [1, 5, 2]
    move_head_slices(prod, cons, total_heads, p_tp, d_tp, sb, db, n)
    for r, c in enumerate(cons):
        hs = kv_heads_of(total_heads, d_tp, r)
        for layer in range(3):
            (kf, vf), (kc, vc) = _tokens(full, layer, sb, n), _tokens(c, layer, db, n)
            assert torch.equal(kc, kf[:, hs.start:hs.stop]) and torch.equal(vc, vf[:, hs.start:hs.stop])

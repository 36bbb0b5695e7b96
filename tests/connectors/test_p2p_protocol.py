"""p2p wire protocol: byte segments translate every pair of KV layouts and block sizes exactly
(moved with memmove here, as a transfer engine would), merge what is contiguous on both sides, and
the handshake check names what cannot be translated."""

from __future__ import annotations

import ctypes
import itertools

import msgspec
import pytest
import torch

from hwkv.connectors.p2p.protocol import (
    Acquire,
    Hello,
    decode,
    encode,
    incompatibility,
    layout_of,
    pair_segments,
    prompt_digest,
)
from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind

from .conftest import move_head_slices

LAYOUTS = list(KVLayoutKind)


def cache(layout: KVLayoutKind, block_size: int, num_blocks: int = 12, fill: bool = False) -> KVCache:
    spec = KVCacheSpec(num_layers=3, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2, head_size=4,
                       dtype=torch.float32)
    kv = KVCache.allocate(spec, layout)
    if fill:
        for t in kv.tensors:
            t.copy_(torch.randn(t.shape))
    return kv


def kv_of(kv: KVCache, layer: int, blocks: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``n`` tokens of a request whose blocks are ``blocks``: [n, H, D] each."""
    lk = kv.layer(layer)
    k, v = lk if isinstance(lk, tuple) else (lk[:, 0], lk[:, 1])
    idx = torch.tensor(blocks)
    flat = lambda t: t[idx].reshape(-1, *t.shape[2:])[:n]  # noqa: E731
    return flat(k), flat(v)


@pytest.mark.parametrize("src_l, dst_l", list(itertools.product(LAYOUTS, LAYOUTS)))
@pytest.mark.parametrize("src_bs, dst_bs", [(4, 4), (4, 8), (8, 4), (4, 2)])
def test_segments_move_exactly_the_token_range(src_l, dst_l, src_bs, dst_bs):
    src, dst = cache(src_l, src_bs, fill=True), cache(dst_l, dst_bs, num_blocks=24)
    n, start = 19, 8  # the consumer already holds [0, start) (a prefix-cache hit)
    sb = [5, 6, 7, 1, 2, 9][:-(-n // src_bs)]
    db = [3, 4, 10, 11, 12, 20, 0, 13, 14, 15][:-(-n // dst_bs)]
    a, b = layout_of(src, "p", "x", "tcp"), layout_of(dst, "d", "y", "tcp")
    assert incompatibility(a, b) == ""
    sp, dp, ln = pair_segments(a, b, sb, db, start, n)
    for s, d, k in zip(sp, dp, ln):
        ctypes.memmove(d, s, k)
    for layer in range(3):
        (ks, vs), (kd, vd) = kv_of(src, layer, sb, n), kv_of(dst, layer, db, n)
        assert torch.equal(ks[start:], kd[start:]) and torch.equal(vs[start:], vd[start:])
        assert not kd[:start].any() and not vd[:start].any()  # nothing outside the range was written
    assert sum(ln) == 3 * 2 * (n - start) * 2 * 4 * 4


def test_contiguous_runs_merge_into_one_segment_per_tensor():
    src, dst = cache(KVLayoutKind.PER_LAYER, 4), cache(KVLayoutKind.PER_LAYER, 4)
    a, b = layout_of(src, "p", "x", "tcp"), layout_of(dst, "d", "y", "tcp")
    sp, dp, ln = pair_segments(a, b, [2, 3, 4, 8], [5, 6, 7, 9], 0, 16)
    assert len(ln) == 2 * 3  # per layer: the run 2..4 → 5..7 (K and V halves merged), then 8 → 9
    sp, dp, ln = pair_segments(a, b, [2, 3], [5, 6], 0, 8, layers=range(1, 2))
    assert len(ln) == 1 and ln[0] == 2 * src.block_nbytes(1)


def test_incompatibilities_are_named():
    base = cache(KVLayoutKind.PER_LAYER, 4)
    a = layout_of(base, "p", "x", "tcp")
    spec = KVCacheSpec(3, 12, 4, 2, 4, torch.bfloat16)
    other = layout_of(KVCache.allocate(spec, KVLayoutKind.PER_LAYER), "d", "y", "tcp")
    assert "dtype differs: 'float32' at engine p, 'bfloat16' at engine d" in incompatibility(a, other)
    one_head = KVCache.allocate(KVCacheSpec(3, 12, 4, 1, 4, torch.float32), KVLayoutKind.PER_LAYER)
    # heterogeneous TP translates by head ranges: tp=1 with 2 heads, tp=2 with 1 head per rank
    assert incompatibility(a, layout_of(one_head, "d", "y", "tcp", tp_rank=1, tp_size=2)) == ""
    why = incompatibility(a, layout_of(one_head, "d", "y", "tcp", tp_size=3))  # a 3-head model
    assert "the models' KV heads differ: 2 at engine p, 3 at engine d" in why
    six = layout_of(KVCache.allocate(KVCacheSpec(3, 12, 4, 3, 4, torch.float32), KVLayoutKind.PER_LAYER),
                    "p", "x", "tcp", tp_size=2)
    why = incompatibility(six, layout_of(base, "d", "y", "tcp", tp_size=3))
    assert "tp=2 (engine p) and tp=3 (engine d) cannot be mapped" in why and "allowed: one divides the other" in why
    lying = msgspec.structs.replace(layout_of(one_head, "d", "y", "tcp", tp_rank=1, tp_size=2), head_start=0)
    assert "rank 1 holds KV heads from 0" in incompatibility(a, lying)
    assert "protocol differs" in incompatibility(a, layout_of(base, "d", "y", "rdma"))


def test_messages_round_trip_without_pickle():
    lay = layout_of(cache(KVLayoutKind.SEPARATE_KV, 4), "e", "127.0.0.1:1", "tcp")
    assert decode(encode(Hello(lay))) == Hello(lay)
    assert decode(encode(Acquire("r-1"))) == Acquire("r-1")
    assert prompt_digest([1, 2, 3], None) != prompt_digest([1, 2, 3], "salt") != prompt_digest([1, 2, 4], "salt")


def _kv_views(kv: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    lk = kv.layer(layer)
    return lk if isinstance(lk, tuple) else (lk[:, 0], lk[:, 1])


@pytest.mark.parametrize("total_heads, p_tp, d_tp", [(4, 2, 1), (4, 1, 2), (2, 4, 1), (4, 4, 2), (2, 1, 2)])
def test_head_slices_assemble_heterogeneous_tensor_parallel_kv(total_heads, p_tp, d_tp):
    """Each consumer rank's blocks, filled from the producer ranks' head slices
    (``map_kv_heads``), equal the consumer's share of the global KV."""
    from hwkv.parallel.kv_mapping import kv_heads_of

    bs, n, blocks = 4, 11, 6

    def rank_cache(tp: int, rank: int, layout: KVLayoutKind) -> KVCache:
        return KVCache.allocate(KVCacheSpec(2, blocks, bs, len(kv_heads_of(total_heads, tp, rank)), 4, torch.float32),
                                layout)

    full = KVCache.allocate(KVCacheSpec(2, blocks, bs, total_heads, 4, torch.float32), KVLayoutKind.PER_LAYER)
    for t in full.tensors:
        t.copy_(torch.randn(t.shape))
    prod = [rank_cache(p_tp, r, KVLayoutKind.PER_LAYER) for r in range(p_tp)]
    cons = [rank_cache(d_tp, r, KVLayoutKind.SEPARATE_KV) for r in range(d_tp)]
    for r, c in enumerate(prod):  # each producer rank holds its heads of the global KV
        hs = kv_heads_of(total_heads, p_tp, r)
        for layer in range(2):
            for mine, glob in zip(_kv_views(c, layer), _kv_views(full, layer)):
                mine.copy_(glob[:, :, hs.start:hs.stop])
    sb, db = [3, 4, 0], [1, 5, 2]
    move_head_slices(prod, cons, total_heads, p_tp, d_tp, sb, db, n)
    for r, c in enumerate(cons):
        hs = kv_heads_of(total_heads, d_tp, r)
        for layer in range(2):
            for mine, glob in zip(_kv_views(c, layer), _kv_views(full, layer)):
                want = glob[torch.tensor(sb)].reshape(-1, total_heads, 4)[:n, hs.start:hs.stop]
                assert torch.equal(mine[torch.tensor(db)].reshape(-1, len(hs), 4)[:n], want)


def test_mismatched_heads_need_a_slice():
    a = layout_of(cache(KVLayoutKind.PER_LAYER, 4), "p", "x", "tcp")
    b = layout_of(KVCache.allocate(KVCacheSpec(3, 12, 4, 1, 4, torch.float32), KVLayoutKind.PER_LAYER), "d", "y", "tcp")
    with pytest.raises(ValueError, match="give the head slice"):
        pair_segments(a, b, [0], [0], 0, 4)


def _reference_segments(src, dst, src_blocks, dst_blocks, start, end, layers=None, heads=None):
    """pair_segments as a plain loop over layers, K|V and token runs (the vectorized one must list
    exactly these segments)."""
    from hwkv.connectors.p2p.protocol import _elem, _unit

    layers = range(src.num_layers) if layers is None else layers
    h_src, h_dst, nh = (0, 0, src.num_kv_heads) if heads is None else heads[2:5]
    head = src.head_size * _elem(src)
    s_tok, d_tok = src.num_kv_heads * head, dst.num_kv_heads * head
    pieces = []
    for layer in layers:
        for kv in (0, 1):
            t = start
            while t < end:
                sb, so = divmod(t, src.block_size)
                db, do = divmod(t, dst.block_size)
                n = min(src.block_size - so, dst.block_size - do, end - t)
                s0 = _unit(src, layer, kv, src_blocks[sb]) + so * s_tok + h_src * head
                d0 = _unit(dst, layer, kv, dst_blocks[db]) + do * d_tok + h_dst * head
                if nh == src.num_kv_heads == dst.num_kv_heads:
                    pieces.append((s0, d0, n * s_tok))
                else:
                    pieces.extend((s0 + i * s_tok, d0 + i * d_tok, nh * head) for i in range(n))
                t += n
    out: tuple[list, list, list] = ([], [], [])
    for s, d, n in sorted(pieces):
        if out[2] and out[0][-1] + out[2][-1] == s and out[1][-1] + out[2][-1] == d:
            out[2][-1] += n
        else:
            for lst, v in zip(out, (s, d, n)):
                lst.append(v)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_vectorized_segments_equal_the_plain_loop(seed):
    import random

    from hwkv.parallel.kv_mapping import map_kv_heads

    rng = random.Random(seed)
    src_l, dst_l = rng.choice(LAYOUTS), rng.choice(LAYOUTS)
    src_bs, dst_bs = rng.choice([2, 4, 8]), rng.choice([2, 4, 8])
    a = layout_of(cache(src_l, src_bs, num_blocks=40), "p", "x", "tcp")
    b = layout_of(cache(dst_l, dst_bs, num_blocks=40), "d", "y", "tcp")
    end = rng.randint(1, 60)
    start = rng.randint(0, end)
    sb = rng.sample(range(40), -(-end // src_bs))
    db = rng.sample(range(40), -(-end // dst_bs))
    layers = rng.choice([None, range(1, 3), range(2, 3)])
    assert pair_segments(a, b, sb, db, start, end, layers=layers) == \
        _reference_segments(a, b, sb, db, start, end, layers=layers)
    sl = rng.choice(map_kv_heads(2, 1, 2))  # the second consumer rank's head of a tp=1 -> tp=2 pair
    c = layout_of(KVCache.allocate(KVCacheSpec(3, 40, dst_bs, 1, 4, torch.float32), dst_l), "d", "y", "tcp",
                  tp_rank=sl.dst_rank, tp_size=2)
    assert pair_segments(a, c, sb, db, start, end, layers=layers, heads=sl) == \
        _reference_segments(a, c, sb, db, start, end, layers=layers, heads=sl)

"""KV layout segments: for every layout, segments of a block list cover exactly those blocks' bytes."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hwkv.interfaces import KVCache, KVCacheSpec, KVLayoutKind, Segment, group_concurrent_contiguous

SPEC = KVCacheSpec(num_layers=3, num_blocks=9, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)


def filled(layout: KVLayoutKind) -> KVCache:
    """A cache whose every byte is distinct per (tensor, block): random bytes with a tag in byte 0."""
    cache = KVCache.allocate(SPEC, layout)
    gen = torch.Generator().manual_seed(0)
    for ti, t in enumerate(cache.tensors):
        raw = t.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
        for b in range(SPEC.num_blocks):
            cache.block_bytes(b)[ti][0] = ti * SPEC.num_blocks + b
    return cache


@pytest.mark.parametrize("layout", list(KVLayoutKind))
@pytest.mark.parametrize(
    "ids", [[0], [3, 4, 5], [5, 3, 4], [8, 0, 1, 2, 7], [2, 4, 6], [1, 2, 3, 4, 5, 6, 7, 8, 0]], ids=str
)
def test_segments_cover_exactly_the_blocks(layout, ids):
    cache = filled(layout)
    n_tensors = {KVLayoutKind.PER_LAYER: 3, KVLayoutKind.SEPARATE_KV: 6, KVLayoutKind.CROSS_LAYER: 1}[layout]
    assert len(cache.tensors) == n_tensors
    segs = cache.segments(ids)
    addrs = cache.addresses(ids)
    assert len(segs) == len(addrs)
    runs = group_concurrent_contiguous(ids)
    assert len(segs) == n_tensors * len(runs)  # consecutive ids merged into one segment per tensor
    total_bytes = 0
    for ti, t in enumerate(cache.tensors):
        mine = [(s, a) for s, a in zip(segs, addrs) if s.tensor == ti]
        covered = torch.zeros(t.numel() * t.element_size(), dtype=torch.bool)
        got = b"".join(ctypes.string_at(ptr, n) for _, (ptr, n) in mine)
        for s, (ptr, n) in mine:
            assert ptr == t.data_ptr() + s.offset and n == s.nbytes
            assert not covered[s.offset : s.offset + s.nbytes].any()  # no overlap
            covered[s.offset : s.offset + s.nbytes] = True
        want = torch.zeros_like(covered)
        nb = cache.block_nbytes(ti)
        for b in ids:
            want[b * nb : (b + 1) * nb] = True
        assert torch.equal(covered, want)
        expect = b"".join(bytes(cache.block_bytes(b)[ti].tolist()) for b in ids)
        assert got == expect  # same bytes, in block-list order
        total_bytes += len(got)
    assert total_bytes == len(ids) * SPEC.bytes_per_block


def test_block_nbytes_and_layer_views():
    for layout in KVLayoutKind:
        cache = filled(layout)
        assert sum(cache.block_nbytes(i) for i in range(len(cache.tensors))) == SPEC.bytes_per_block
        layer = cache.layer(1)
        if layout is KVLayoutKind.SEPARATE_KV:
            assert tuple(layer[0].shape) == (9, 4, 2, 8) and layer[0].data_ptr() == cache.tensors[2].data_ptr()
        else:
            assert tuple(layer.shape) == (9, 2, 4, 2, 8)
        # A write through the layer view lands inside that block's segment and nowhere else.
        for t in cache.tensors:
            t.view(-1).view(torch.uint8).fill_(0xFF)
        k = layer[0] if isinstance(layer, tuple) else layer
        k[5].zero_()
        ti = {KVLayoutKind.PER_LAYER: 1, KVLayoutKind.SEPARATE_KV: 2, KVLayoutKind.CROSS_LAYER: 0}[layout]
        (seg,) = [s for s in cache.segments([5]) if s.tensor == ti]
        for tj, t in enumerate(cache.tensors):
            zeros = torch.nonzero(t.view(-1).view(torch.uint8) == 0).flatten()
            if tj != ti:
                assert zeros.numel() == 0
            else:
                assert zeros.numel() == k[5].numel() * k.element_size()
                assert int(zeros.min()) >= seg.offset and int(zeros.max()) < seg.offset + seg.nbytes


def test_segments_reject_out_of_range():
    cache = KVCache.allocate(SPEC, KVLayoutKind.PER_LAYER)
    with pytest.raises(IndexError):
        cache.segments([9])
    with pytest.raises(IndexError):
        cache.segments([-1])
    assert cache.segments([]) == []
    assert cache.segments([2]) == [Segment(t, 2 * cache.block_nbytes(t), cache.block_nbytes(t)) for t in range(3)]


def test_group_concurrent_contiguous_examples():
    assert group_concurrent_contiguous([]) == []
    assert group_concurrent_contiguous([1, 2, 3, 7, 8, 4]) == [(1, 1, 3), (7, 7, 2), (4, 4, 1)]
    assert group_concurrent_contiguous([1, 2, 3], [5, 6, 7]) == [(1, 5, 3)]
    assert group_concurrent_contiguous([1, 2, 3], [5, 6, 9]) == [(1, 5, 2), (3, 9, 1)]  # dst breaks the run
    assert group_concurrent_contiguous([1, 2, 4], [5, 6, 7]) == [(1, 5, 2), (4, 7, 1)]  # src breaks the run
    assert group_concurrent_contiguous([3, 3], [0, 1]) == [(3, 0, 1), (3, 1, 1)]  # repeats never merge
    assert group_concurrent_contiguous([2, 1], [1, 2]) == [(2, 1, 1), (1, 2, 1)]  # descending never merges
    with pytest.raises(ValueError, match="differ in length"):
        group_concurrent_contiguous([1, 2], [1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(0, 3)), max_size=300))
def test_group_concurrent_contiguous_matches_a_plain_scan(steps):
    """Short lists and long ones (the vectorised branch) merge alike: runs are maximal, in order."""
    src, dst, s, d = [], [], 5, 50
    for step, ds, dd in steps:  # mostly +1 on both sides, sometimes a jump on either
        s, d = (s + 1, d + 1) if step else (s + ds, d + dd)
        src.append(s)
        dst.append(d)
    runs = group_concurrent_contiguous(src, dst)
    assert [x for s0, _, n in runs for x in range(s0, s0 + n)] == src
    assert [x for _, d0, n in runs for x in range(d0, d0 + n)] == dst
    assert all(not (a[0] + a[2] == b[0] and a[1] + a[2] == b[1]) for a, b in zip(runs, runs[1:]))  # maximal


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=20))
def test_group_concurrent_contiguous_property(pairs):
    src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
    runs = group_concurrent_contiguous(src, dst)
    expanded = [(s + i, d + i) for s, d, n in runs for i in range(n)]
    assert expanded == pairs  # runs reproduce the pairs in order
    for (s0, d0, n0), (s1, d1, _) in zip(runs, runs[1:]):
        assert not (s1 == s0 + n0 and d1 == d0 + n0)  # maximal: adjacent runs could not merge


def test_paired_addresses_merge_runs_consecutive_on_both_sides():
    spec = KVCacheSpec(2, 10, 4, 2, 8, torch.float16)
    a, b = KVCache.allocate(spec, KVLayoutKind.SEPARATE_KV), KVCache.allocate(spec, KVLayoutKind.SEPARATE_KV)
    src, dst, lens = a.paired_addresses(b, [5, 6, 7, 2, 0], [0, 1, 2, 6, 4])
    nb = a.block_nbytes(0)
    runs = [(5, 0, 3), (2, 6, 1), (0, 4, 1)]  # 5-7 -> 0-2 merged; the singles stay single
    assert len(src) == len(dst) == len(lens) == len(runs) * len(a.tensors)
    for ti, (ta, tb) in enumerate(zip(a.tensors, b.tensors)):
        for j, (s, d, n) in enumerate(runs):
            k = ti * len(runs) + j
            assert (src[k], dst[k], lens[k]) == (ta.data_ptr() + s * nb, tb.data_ptr() + d * nb, n * nb)


def test_paired_addresses_rejects_mismatches():
    spec = KVCacheSpec(1, 4, 4, 2, 8, torch.float16)
    a = KVCache.allocate(spec, KVLayoutKind.PER_LAYER)
    with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
        a.paired_addresses(a, [0, 1], [2])
    with pytest.raises(IndexError, match=r"destination block id 4 out of range \[0, 4\)"):
        a.paired_addresses(a, [0], [4])
    with pytest.raises(IndexError, match=r"source block id -1 out of range"):
        a.paired_addresses(a, [-1], [0])
    other = KVCache.allocate(KVCacheSpec(1, 4, 8, 2, 8, torch.float16), KVLayoutKind.PER_LAYER)
    with pytest.raises(ValueError, match="block sizes differ"):
        a.paired_addresses(other, [0], [0])
    two = KVCache.allocate(KVCacheSpec(2, 4, 4, 2, 8, torch.float16), KVLayoutKind.PER_LAYER)
    with pytest.raises(ValueError, match="1 KV tensors here but 2 at the destination"):
        a.paired_addresses(two, [0], [0])


def test_fp8_v_pages_are_stored_transposed():
    """The fp8 page format (hwkv.interfaces.kv_quant): K token-major, V ``[H_kv, D, block_size]`` per block.
    The reference write puts V's code of (token t, head h, dim d) at byte ``h * D * bs + d * bs + t`` of the
    block's V half, and ``v_token_view`` reads it back token-major."""
    from hwkv.interfaces.kv_quant import FP8_E4M3, quantize, v_token_view
    from hwkv.reference.attention import write_kv

    nb, bs, hkv, d = 3, 4, 2, 8
    kv = torch.zeros(nb, 2, bs, hkv, d, dtype=FP8_E4M3)
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, hkv, d, generator=g), torch.randn(2, hkv, d, generator=g)
    write_kv(key, value, kv, torch.tensor([6, 1]))  # block 1 token 2, block 0 token 1
    raw = kv.view(torch.uint8)
    want_v = quantize(value, 1.0).view(torch.uint8)
    for row, (blk, t) in enumerate(((1, 2), (0, 1))):
        assert torch.equal(raw[blk, 0, t], quantize(key[row], 1.0).view(torch.uint8))  # K token-major
        page = raw[blk, 1].flatten()
        for h in range(hkv):
            for dim in range(d):
                assert page[h * d * bs + dim * bs + t] == want_v[row, h, dim]
        assert torch.equal(v_token_view(kv[:, 1])[blk, t].view(torch.uint8), want_v[row])
    assert int((raw[:, 1] != 0).sum()) == int((want_v != 0).sum())  # nothing else written

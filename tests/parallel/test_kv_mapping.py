"""Heterogeneous-TP KV head mapping: every consumer head comes from a producer rank holding it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hwkv.parallel.kv_mapping import HeadSlice, kv_heads_of, map_kv_heads


def test_worked_example_p4_to_d2():  # the example in docs/parallelism.md
    assert map_kv_heads(8, 4, 2) == [HeadSlice(0, 0, 0, 0, 2), HeadSlice(1, 0, 0, 2, 2),
                                     HeadSlice(2, 1, 0, 0, 2), HeadSlice(3, 1, 0, 2, 2)]


def test_p2_to_d4_and_replicated():
    assert map_kv_heads(8, 2, 4) == [HeadSlice(0, 0, 0, 0, 2), HeadSlice(0, 1, 2, 0, 2),
                                     HeadSlice(1, 2, 0, 0, 2), HeadSlice(1, 3, 2, 0, 2)]
    # 2 KV heads on 4 producer ranks (each head on 2 ranks) -> 1 consumer: reads spread over holders
    assert map_kv_heads(2, 4, 1) == [HeadSlice(0, 0, 0, 0, 1), HeadSlice(2, 0, 0, 1, 1)]
    assert map_kv_heads(1, 1, 4) == [HeadSlice(0, d, 0, 0, 1) for d in range(4)]


def test_refusals():
    with pytest.raises(ValueError, match="one must divide the other"):
        map_kv_heads(8, 4, 3)
    with pytest.raises(ValueError, match="num_kv_heads 6 and tp 4"):
        map_kv_heads(6, 2, 4)


@given(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_every_consumer_head_exactly_once_from_a_holder(kv, p_tp, d_tp):
    slices = map_kv_heads(kv, p_tp, d_tp)
    for d in range(d_tp):
        mine = kv_heads_of(kv, d_tp, d)
        got = []
        for s in (s for s in slices if s.dst_rank == d):
            src = kv_heads_of(kv, p_tp, s.src_rank)
            assert s.src_head >= 0 and s.src_head + s.num_heads <= len(src)
            for i in range(s.num_heads):
                assert src[s.src_head + i] == mine[s.dst_head + i]  # the same global head
                got.append(s.dst_head + i)
        assert sorted(got) == list(range(len(mine)))

"""The CUDA custom all-reduce's host-side decisions (no GPU needed): when it is not built at all,
and the bad-mode error. The kernels and peer memory are exercised on two GPUs by
``hwkv bench allreduce`` (bit-exact check of every path) and tests/parallel/test_tp_cuda.py."""

from __future__ import annotations

import pytest
from hwkv_cuda.allreduce import make_custom_all_reduce, triton_next_pow2


class _Comm:
    def __init__(self, world_size: int, store: object = object()):
        self.rank, self.world_size, self.store, self.group_name = 0, world_size, store, "g"


def test_not_built_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv("HWKV_CUSTOM_ALLREDUCE", raising=False)  # the default: auto
    assert make_custom_all_reduce(_Comm(1)) is None  # one rank: nothing to reduce
    assert make_custom_all_reduce(_Comm(9)) is None  # more ranks than the push kernel's peer table
    assert make_custom_all_reduce(_Comm(2, store=None)) is None  # a communicator without a group store
    monkeypatch.setenv("HWKV_CUSTOM_ALLREDUCE", "off")
    assert make_custom_all_reduce(_Comm(2)) is None


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setenv("HWKV_CUSTOM_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match=r"HWKV_CUSTOM_ALLREDUCE='fast' \(allowed: auto, off, symm, push\)"):
        make_custom_all_reduce(_Comm(2))


def test_next_pow2():
    assert [triton_next_pow2(n) for n in (1, 2, 3, 4096, 4097, 14336)] == [1, 2, 4, 4096, 8192, 16384]


@pytest.mark.parametrize("peer, same", [(0, True), (1, False)])
def test_symmetric_memory_is_not_tried_when_every_rank_sees_the_same_index(peer, same):
    """A tp engine's ranks each see one GPU as cuda:0: symmetric memory's rendezvous refuses that, and a
    process's second rendezvous hung (batch 3 of 2026-11-28), so it is skipped when the indices agree."""
    from hwkv_cuda.allreduce import _same_device_index

    class TwoRanks:  # rank 0 at cuda:0, its peer at cuda:``peer`` (the same calls: the index, then its negative)
        calls = 0

        def all_reduce_min(self, v):
            self.calls += 1
            return min(v, peer if self.calls == 1 else -peer)

    assert _same_device_index(TwoRanks(), "cuda:0") is same

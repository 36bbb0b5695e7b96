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

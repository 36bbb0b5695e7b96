"""TorchDistCommunicator in one-rank gloo groups: the collectives' results, the backend's custom
all-reduce hook (used when it takes the tensor, the default when it declines), several groups in
one process (none of them torch.distributed's default group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hwkv.parallel.communicator import TorchDistCommunicator, open_store
from hwkv.reference.device import CpuDevice


class _Device(CpuDevice):
    def __init__(self):
        super().__init__()
        self.calls: list[int] = []

    def custom_all_reduce(self, comm):
        def fn(t):
            self.calls.append(t.numel())
            return t.mul_(1) if t.numel() <= 4 else None  # takes small tensors, declines the rest
        return fn


@pytest.fixture
def comm():
    dev = _Device()
    c = TorchDistCommunicator(dev, 0, 1, 0, timeout_s=10, store=open_store(1, 10))
    yield c, dev
    c.close()
    assert not dist.is_initialized()


def test_collectives_and_custom_all_reduce(comm):
    c, dev = comm
    small, big = torch.arange(4.0), torch.arange(8.0)
    assert c.all_reduce(small) is small and torch.equal(small, torch.arange(4.0))
    assert c.all_reduce(big) is big and torch.equal(big, torch.arange(8.0))  # declined: torch.distributed's
    assert dev.calls == [4, 8]
    assert torch.equal(c.all_gather(torch.ones(2, 3), dim=-1), torch.ones(2, 3))
    assert c.all_reduce_min(7) == 7
    t = torch.tensor([5])
    assert c.broadcast(t) is t and t.item() == 5
    out = c.all_reduce_add(torch.ones(3), torch.full((3,), 2.0))  # the custom hook has no fused add: default
    assert out.tolist() == [3.0, 3.0, 3.0]
    assert not dist.is_initialized()  # not the default group: another engine's group can live beside it
    other = TorchDistCommunicator(CpuDevice(), 0, 1, 0, timeout_s=10, store=open_store(1, 10), group="other")
    try:
        assert other.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0] and c.all_reduce_min(3) == 3
    finally:
        other.close()
    assert c.all_reduce_min(4) == 4  # closing one group leaves the other working
    with pytest.raises(RuntimeError, match="closed"):
        other.all_reduce(torch.ones(2))


def test_fused_add_hook_is_used():
    class Fused(CpuDevice):
        def custom_all_reduce(self, comm):
            def fn(t):
                return None

            fn.all_reduce_add = lambda t, residual: t + residual + 100  # marks its result
            fn.all_reduce_add_rms_norm = lambda t, residual, weight, eps: (weight, t + residual)
            fn.all_gather = lambda t, dim: t + 7 if t.dim() == 2 else None  # takes 2-D tensors, marks them
            return fn

    c = TorchDistCommunicator(Fused(), 0, 1, 0, timeout_s=10, store=open_store(1, 10))
    try:
        assert c.all_reduce_add(torch.ones(2), torch.ones(2)).tolist() == [102.0, 102.0]
        assert c.all_gather(torch.ones(1, 2), dim=-1).tolist() == [[8.0, 8.0]]  # the hook's
        assert c.all_gather(torch.ones(2), dim=-1).tolist() == [1.0, 1.0]  # declined: the group's gather
        x, h = c.all_reduce_add_rms_norm(torch.ones(2), torch.ones(2), torch.full((2,), 5.0), 1e-6)
        assert x.tolist() == [5.0, 5.0] and h.tolist() == [2.0, 2.0]
    finally:
        c.close()
    plain = TorchDistCommunicator(CpuDevice(), 0, 1, 0, timeout_s=10, store=open_store(1, 10))
    try:  # no backend fusion: the caller runs all_reduce and its own add + norm
        assert plain.all_reduce_add_rms_norm(torch.ones(2), torch.ones(2), torch.ones(2), 1e-6) is None
    finally:
        plain.close()


def test_failed_custom_all_reduce_leaves_no_group():
    """A backend hook that raises during construction must not leave the process group initialised
    (the caller never gets the object to close, and the next engine could not start)."""

    class Broken(CpuDevice):
        def custom_all_reduce(self, comm):
            raise RuntimeError("no peer access")

    with pytest.raises(RuntimeError, match="no peer access"):
        TorchDistCommunicator(Broken(), 0, 1, 0, timeout_s=10, store=open_store(1, 10))
    assert not dist.is_initialized()


def test_close_is_bounded_when_the_group_never_returns(monkeypatch):
    """A backend whose abort blocks (an NCCL abort after the peers left did on 2 x H200) leaves close()
    after CLOSE_WAIT_S with a warning, not forever."""
    import threading
    import time

    import pytest

    import hwkv.parallel.communicator as c

    stuck = threading.Event()

    class _Stuck:
        def abort(self):
            stuck.wait(30)

    comm = c.TorchDistCommunicator.__new__(c.TorchDistCommunicator)
    comm._custom, comm._pg, comm.backend_name, comm.store, comm._root = None, _Stuck(), "nccl", None, None
    monkeypatch.setattr(c, "CLOSE_WAIT_S", 0.3)
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="did not return within"):
        comm.close()
    assert time.monotonic() - t0 < 5 and comm._pg is None
    stuck.set()


def test_all_reduce_start_sums_in_place_when_waited_for(comm, monkeypatch):
    """all_reduce_start: the custom hook's tensors summed at once, the others by the group's own work,
    each ``wait()`` returning its tensor; overlap_tokens from HWKV_TP_OVERLAP_TOKENS (0 by default)."""
    c, dev = comm
    small, big = torch.arange(4.0), torch.arange(8.0)
    waits = [c.all_reduce_start(small), c.all_reduce_start(big)]
    assert [w() for w in waits] == [small, big] and torch.equal(big, torch.arange(8.0))
    assert dev.calls == [4, 8] and c.overlap_tokens == 0
    monkeypatch.setenv("HWKV_TP_OVERLAP_TOKENS", "4096")
    other = TorchDistCommunicator(CpuDevice(), 0, 1, 0, timeout_s=10, store=open_store(1, 10), group="ov")
    try:
        assert other.overlap_tokens == 4096
    finally:
        other.close()

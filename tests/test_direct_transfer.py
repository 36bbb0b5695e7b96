"""Same-host direct transfer (hwkv.transfer.direct) with the ``cma`` mover: the Transfer contract in
one process and between two (cross-memory attach), the probe, revocation, a dead peer and close —
the CPU stand-in for ``cuda_ipc``, whose own tests run on the GPU (backends/cuda/tests/test_ipc.py)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time

import pytest
import torch

from hwkv.interfaces.transfer import TransferError, TransferTimeout
from hwkv.transfer.direct import DirectTransfer, HostMover, merge_runs

PEER = """
import json, sys, torch
from hwkv.transfer.direct import DirectTransfer, HostMover
buf = torch.zeros(1 << 16, dtype=torch.uint8)
ep = DirectTransfer(HostMover())
ep.register(buf.data_ptr(), buf.numel())
print(json.dumps({"endpoint": ep.endpoint(), "ptr": buf.data_ptr()}), flush=True)
for line in sys.stdin:
    if line.startswith("sum"):
        print(json.dumps({"sum": int(buf.long().sum()), "head": buf[:8].tolist()}), flush=True)
    elif line.startswith("unregister"):
        ep.unregister(buf.data_ptr()); print("{}", flush=True)
    else:
        break
"""


@pytest.fixture
def pair():
    a, b = DirectTransfer(HostMover(), timeout_s=2), DirectTransfer(HostMover(), timeout_s=2)
    yield a, b
    a.close()
    b.close()


def _buf(n: int, fill: int | None = None) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8) if fill is None else torch.full((n,), fill, dtype=torch.uint8)


def test_merge_runs_joins_runs_contiguous_on_both_sides_only():
    assert merge_runs([0, 10, 20, 40], [100, 110, 130, 150], [10, 10, 10, 5]) == ([0, 20, 40], [100, 130, 150],
                                                                                   [20, 10, 5])


def test_write_and_async_read_round_trip_in_process(pair):
    a, b = pair
    src, dst, back = _buf(1 << 14), _buf(1 << 14, 0), _buf(1 << 14, 0)
    a.register(src.data_ptr(), src.numel())
    a.register(back.data_ptr(), back.numel())
    b.register(dst.data_ptr(), dst.numel())
    # scattered pieces: 4 KiB pieces written in reverse order
    sp = [src.data_ptr() + i * 4096 for i in range(4)]
    dp = [dst.data_ptr() + (3 - i) * 4096 for i in range(4)]
    a.write(b.endpoint(), sp, dp, [4096] * 4)
    assert torch.equal(dst.view(4, 4096), src.view(4, 4096).flip(0))
    batch = a.submit_read(b.endpoint(), [back.data_ptr()], [dst.data_ptr()], [1 << 14])
    a.wait(batch)
    assert torch.equal(back, dst)
    with pytest.raises(ValueError, match="not a pending transfer batch"):
        a.poll(batch)


def test_bad_arguments_and_unregistered_ranges_are_refused(pair):
    a, b = pair
    src, dst = _buf(4096), _buf(4096, 0)
    b.register(dst.data_ptr(), 4096)
    with pytest.raises(ValueError, match="lengths"):
        a.write(b.endpoint(), [src.data_ptr()], [dst.data_ptr()], [])
    with pytest.raises(TransferError, match="not inside a registered buffer"):
        a.write(b.endpoint(), [src.data_ptr()], [dst.data_ptr()], [16])
    a.register(src.data_ptr(), 4096)
    with pytest.raises(TransferError, match="not inside a buffer the peer registered"):
        a.write(b.endpoint(), [src.data_ptr()], [dst.data_ptr() + 4000], [200])
    with pytest.raises(ValueError, match="overlaps"):
        a.register(src.data_ptr() + 8, 16)
    with pytest.raises(ValueError, match="not a registered buffer"):
        a.unregister(src.data_ptr() + 8)
    assert dst.sum() == 0  # nothing was written by the refused calls


def test_between_processes_with_revocation_and_a_dead_peer():
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ep = DirectTransfer(HostMover(), timeout_s=2)
    try:
        info = json.loads(peer.stdout.readline())
        src = _buf(4096)
        ep.register(src.data_ptr(), 4096)
        try:
            ep.probe(info["endpoint"])
        except TransferError as e:  # cross-memory attach not permitted here: the p2p handshake falls back
            pytest.skip(f"cma refused on this host: {e}")
        ep.write(info["endpoint"], [src.data_ptr(), src.data_ptr() + 100], [info["ptr"] + 8, info["ptr"]], [8, 8])
        peer.stdin.write("sum\n")
        peer.stdin.flush()
        got = json.loads(peer.stdout.readline())
        assert got["head"] == src[100:108].tolist()
        assert got["sum"] == int(src[:8].long().sum() + src[100:108].long().sum())
        peer.stdin.write("unregister\n")
        peer.stdin.flush()
        peer.stdout.readline()
        with pytest.raises(TransferError, match="not inside a buffer the peer registered"):
            ep.write(info["endpoint"], [src.data_ptr()], [info["ptr"]], [8])
        peer.kill()
        peer.wait(10)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            ep.write(info["endpoint"], [src.data_ptr()], [info["ptr"]], [8])
        assert time.monotonic() - t0 < 3  # the endpoint's timeout bounds it (pid gone, or describe unanswered)
    finally:
        ep.close()
        if peer.poll() is None:
            peer.kill()
        peer.wait(10)


def test_probe_failure_names_the_reason(pair, monkeypatch):
    a, b = pair

    def refuse(op, pid, local, target, lengths):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(a.mover, "submit", refuse)
    with pytest.raises(TransferError, match="not permitted"):
        a.probe(b.endpoint())


def test_another_host_is_refused_at_describe(pair, monkeypatch):
    a, b = pair
    monkeypatch.setattr(b, "host_id", "other-boot/1")
    with pytest.raises(TransferError, match="another host"):
        a.probe(b.endpoint())


def test_unanswering_peer_times_out_and_close_is_idempotent(pair):
    a, _ = pair
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)  # accepts, never answers
    src = _buf(64)
    a.register(src.data_ptr(), 64)
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        a.write(f"127.0.0.1:{s.getsockname()[1]}", [src.data_ptr()], [ctypes.addressof(ctypes.c_int())], [4])
    assert time.monotonic() - t0 < 4
    s.close()
    a.close()
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.register(src.data_ptr(), 64)
    assert a.registered_buffers() == []


class _Event:
    def __init__(self, log: list[str]):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("synchronize")


def test_after_event_is_waited_by_the_host_when_the_mover_cannot_order_on_the_device(pair):
    """A mover without ``orders_after`` (cma): ``submit_write(after=ev)`` waits for ``ev`` on the host
    before the copies start; one that orders on the device receives the event and the host goes on."""
    a, b = pair
    src, dst = _buf(4096), _buf(4096, 0)
    a.register(src.data_ptr(), 4096)
    b.register(dst.data_ptr(), 4096)
    a.write(b.endpoint(), [src.data_ptr()], [dst.data_ptr()], [16])  # the peer described and probed first
    log: list[str] = []
    submit = a.mover.submit
    a.mover.submit = lambda *args, **kw: (log.append(f"submit after={kw.get('after')}"), submit(*args))[1]
    assert a.orders_after is False
    a.wait(a.submit_write(b.endpoint(), [src.data_ptr()], [dst.data_ptr()], [4096], after=_Event(log)))
    assert log == ["synchronize", "submit after=None"] and torch.equal(dst, src)

    log.clear()
    ev = _Event(log)
    a.mover.orders_after = True  # as cuda_ipc: the event goes to the mover, never waited on here
    a.wait(a.submit_read(b.endpoint(), [src.data_ptr()], [dst.data_ptr()], [4096], after=ev))
    assert log == [f"submit after={ev}"]

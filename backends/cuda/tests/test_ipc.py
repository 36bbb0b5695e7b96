"""cuda_ipc (hwkv_cuda.ipc + hwkv.transfer.direct) between two processes: bytes exact for every copy
method, same GPU and across GPUs; the peer's unregister, close and death end in bounded errors;
nothing stays mapped after close."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hwkv.interfaces.transfer import TransferError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")
N = 8 << 20
PEER = Path(__file__).with_name("ipc_peer.py")
TWO = torch.cuda.is_available() and torch.cuda.device_count() > 1


class Peer:
    def __init__(self, device: str, env: dict | None = None):
        self.p = subprocess.Popen([sys.executable, str(PEER), device, str(N)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        line = self.p.stdout.readline()
        assert line, "the peer process died at start"
        self.info = json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, f"the peer died on {cmd!r}"
        return json.loads(line)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)


def _checks(t: torch.Tensor) -> dict:
    w = torch.arange(t.numel(), device=t.device, dtype=torch.int64) % 65521
    return {"sum": int(t.long().sum()), "weighted": int((t.long() * w).sum())}


def _endpoint(device: str, method: str = "auto"):
    from hwkv_cuda.ipc import CudaIpcMover

    from hwkv.transfer.direct import DirectTransfer

    return DirectTransfer(CudaIpcMover(device, method=method), timeout_s=5)


def _opened() -> int:
    from hwkv_cuda.ipc import _Opened

    return len(_Opened.maps)


@pytest.mark.parametrize("peer_device", ["cuda:0", *(pytest.param(d, marks=pytest.mark.skipif(
    not TWO, reason="needs two GPUs")) for d in ("cuda:1", "only-1"))])
@pytest.mark.parametrize("method", ["memcpy", "batch", "kernel", "auto"])
def test_write_read_exact_between_processes(peer_device, method):
    # only-1: the peer sees GPU 1 alone (CUDA_VISIBLE_DEVICES=1, its cuda:0), as a tensor-parallel rank does
    peer = Peer("cuda:0", {"CUDA_VISIBLE_DEVICES": "1"}) if peer_device == "only-1" else Peer(peer_device)
    ep = _endpoint("cuda:0", method)
    try:
        src = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda:0")
        back = torch.zeros(N, dtype=torch.uint8, device="cuda:0")
        ep.register(src.data_ptr(), N)
        ep.register(back.data_ptr(), N)
        seg, k = 64 << 10, 128  # 128 scattered 64 KiB pieces: the dst order reversed (no merging)
        sp = [src.data_ptr() + i * seg for i in range(k)]
        dp = [peer.info["ptr"] + (k - 1 - i) * seg for i in range(k)]
        ep.write(peer.info["endpoint"], sp, dp, [seg] * k)
        expect = torch.zeros(N, dtype=torch.uint8, device="cuda:0")
        expect[: k * seg] = src[: k * seg].view(k, seg).flip(0).reshape(-1)
        assert peer.ask("sum") == _checks(expect)
        b = ep.submit_read(peer.info["endpoint"], [back.data_ptr()], [peer.info["ptr"]], [N])
        ep.wait(b)
        assert torch.equal(back, expect)
    finally:
        ep.close()
        peer.stop()
    assert _opened() == 0  # close detached the peer's memory


def test_peer_unregister_close_and_death_are_bounded_errors():
    peer = Peer("cuda:1" if TWO else "cuda:0")
    ep = _endpoint("cuda:0")
    try:
        src = torch.ones(N, dtype=torch.uint8, device="cuda:0")
        ep.register(src.data_ptr(), N)
        ep.write(peer.info["endpoint"], [src.data_ptr()], [peer.info["ptr"]], [4096])
        assert _opened() == 1
        peer.ask("unregister")  # revoked: the next use re-describes and refuses the range
        with pytest.raises(TransferError, match="not inside a buffer the peer registered"):
            ep.write(peer.info["endpoint"], [src.data_ptr()], [peer.info["ptr"]], [4096])
        assert _opened() == 0
        peer.stop()  # died: refused at once by pid, no hang
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            ep.write(peer.info["endpoint"], [src.data_ptr()], [peer.info["ptr"]], [4096])
        assert time.monotonic() - t0 < 6
    finally:
        ep.close()
        peer.stop()
    assert _opened() == 0


def test_expandable_segments_are_refused_with_the_reason():
    from hwkv_cuda.ipc import CudaIpcMover

    code = ("import torch; from hwkv_cuda.ipc import CudaIpcMover\n"
            "t = torch.empty(1 << 22, device='cuda:0')\n"
            "try:\n    CudaIpcMover('cuda:0').export(t.data_ptr(), 16)\nexcept Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "expandable" in out.stdout, out.stdout + out.stderr
    assert CudaIpcMover  # the plain allocator exports (the tests above)


def test_after_event_orders_the_copy_on_the_device_without_a_host_wait():
    """``submit_write(after=ev)``: the copy streams wait for an event of the forward's stream (a
    layerwise push of a layer the forward just wrote) — the bytes are the ones written before the
    event, and the host is not held while the device gets there."""
    peer = Peer("cuda:1" if TWO else "cuda:0")
    ep = _endpoint("cuda:0")
    try:
        n = 1 << 20
        src = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
        ep.register(src.data_ptr(), n)
        ep.write(peer.info["endpoint"], [src.data_ptr()], [peer.info["ptr"]], [n])  # describe, probe, attach first
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # the "forward": ~1 s of device time before the layer's KV exists
        src.fill_(7)
        ev = torch.cuda.Event()
        ev.record()
        t0 = time.perf_counter()
        b = ep.submit_write(peer.info["endpoint"], [src.data_ptr()], [peer.info["ptr"]], [n], after=ev)
        submitted = time.perf_counter() - t0
        assert not ev.query(), "the sleep ended before the submit returned: the test shows nothing"
        ep.wait(b, timeout_s=30)
        assert peer.ask("sum")["sum"] == 7 * n
        assert submitted < 0.5, f"submit_write(after=) held the host {submitted:.3f} s"
    finally:
        ep.close()
        peer.stop()
    assert _opened() == 0

"""MooncakeStore against a real mooncake_master that hangs (SIGSTOP) or dies (SIGKILL) mid-use:
every call ends within its timeout with a named error, other threads keep running meanwhile,
close is fast, nothing is printed by the wheel, and a master restarted in place is used again."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

import numpy as np
import pytest

from hwkv.interfaces import StoreError, StoreTimeout, StoreUnavailable
from hwkv.stores import create_store
from hwkv.stores.mooncake_faults import reaper
from hwkv.stores.mooncake_service import mooncake_master
from hwkv.testing.mooncake import skip_unless_mooncake

pytestmark = pytest.mark.mooncake
skip_unless_mooncake(allow_module_level=True)

MiB = 1 << 20
TIMEOUT, CONNECT = 1.0, 0.5  # the store's timeout_s / connect_timeout_s here (defaults: 5 s / 3 s)
SLACK = 1.0  # scheduling on a loaded 2-core box
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", re.M)
# A frozen interpreter lets the counting thread run ~0-2 times per call; a free one ~500/s here.
RUNNING = 20


class Spinner:
    """A Python thread counting loop iterations: proof that the interpreter was not frozen."""

    def __init__(self) -> None:
        self.count, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop.is_set():
            self.count += 1
            time.sleep(0.001)

    def __enter__(self) -> Spinner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def timed(fn, *args, **kwargs):
    """``(exception or result, seconds, spinner iterations)`` of ``fn(*args, **kwargs)``."""
    with Spinner() as sp:
        t = time.monotonic()
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the caller asserts on it
            out = e
        return out, time.monotonic() - t, sp.count


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


@contextlib.contextmanager
def stopped(master):
    """The master stopped (SIGSTOP), as a hung one: it accepts connections (the kernel does) and
    answers nothing. Waits until it really is stopped (a signal is delivered asynchronously)."""
    os.kill(master.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while state(master.pid) not in "Tt":
            assert time.monotonic() < deadline, "mooncake_master did not stop within 5 s"
            time.sleep(0.001)
        yield
    finally:
        os.kill(master.pid, signal.SIGCONT)


def reaped(master: str, timeout_s: float = 10) -> bool:
    """Whether the reaper closed every abandoned client of ``master`` within ``timeout_s`` (so that
    none is left to the wheel's slow exit handler). Counted per master: clients other tests left for
    masters that never come back stay pending until exit."""
    deadline = time.monotonic() + timeout_s
    while reaper.pending(master) and time.monotonic() < deadline:
        time.sleep(0.05)
    return reaper.pending(master) == 0


def kill(master) -> None:
    os.kill(master.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # gone once its RPC port refuses
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(master.pid, os.WNOHANG)[0]:
                return
        time.sleep(0.01)
    raise AssertionError(f"mooncake_master {master.pid} survived SIGKILL for 5 s")


@pytest.fixture
def master():
    with mooncake_master() as m:
        yield m


@pytest.fixture
def buf():
    return np.random.default_rng(0).integers(0, 256, MiB, dtype=np.uint8)


def open_store(m, buf):
    s = create_store("mooncake", master=m.master, global_segment_size=16 * MiB, timeout_s=TIMEOUT,
                     connect_timeout_s=CONNECT)
    s.register_buffer(buf.ctypes.data, buf.nbytes)
    assert s.put(["k"], [[(buf.ctypes.data, 4096)]])[0].ok
    return s


def every_call(s, buf):
    p = buf.ctypes.data
    return {"put": lambda: s.put(["k2"], [[(p, 4096)]]), "get": lambda: s.get(["k"], [[(p + 8192, 4096)]]),
            "multi-put": lambda: s.put(["k3"], [[(p, 100), (p + 200, 100)]]),
            "exists": lambda: s.exists(["k"]), "remove": lambda: s.remove(["k"]), "clear": s.clear}


def test_hung_master_at_create_fails_within_connect_timeout(master):
    """setup() waits for the master holding the GIL; the probe before it keeps threads running."""
    with stopped(master):
        err, took, spins = timed(create_store, "mooncake", master=master.master, connect_timeout_s=CONNECT)
    assert isinstance(err, StoreTimeout), err
    assert re.match(rf"create: mooncake master at {master.master} unreachable: no answer within 0.5 s", str(err))
    assert took < CONNECT + SLACK and spins > RUNNING, (took, spins)


def test_master_hanging_after_the_probe_bounds_setup(master, monkeypatch):
    """The race the probe cannot close: the master hangs between the probe and setup(), which
    holds the GIL. setup's client retries (20 by default, one RPC deadline each) are cut to 3."""
    import hwkv.stores.mooncake as mooncake_store

    monkeypatch.setattr(mooncake_store, "probe_master", lambda *a: None)
    with stopped(master):
        err, took, _ = timed(create_store, "mooncake", master=master.master, timeout_s=TIMEOUT,
                             connect_timeout_s=CONNECT, global_segment_size=16 * MiB)
    assert isinstance(err, StoreError) and "setup" in str(err), err
    assert took < 4 * TIMEOUT / 2 + SLACK, took  # at most 3 retries + 1 of half timeout_s each


def test_hung_master_mid_use_times_out_and_close_is_fast(master, buf, capfd):
    s = open_store(master, buf)
    with stopped(master):
        for op, call in every_call(s, buf).items():
            err, took, spins = timed(call)
            assert isinstance(err, StoreTimeout), (op, err)
            assert master.master in str(err), (op, err)
            assert took < TIMEOUT + SLACK and spins > RUNNING, (op, took, spins)
        _, took, spins = timed(s.close)
        assert took < CONNECT + SLACK and spins > RUNNING, (took, spins)
        assert reaper.pending(master.master) == 1  # the client waits for its master
    assert s.registered_buffers() == []
    with pytest.raises(StoreError, match="closed"):
        s.exists(["k"])
    s.close()  # idempotent
    assert reaped(master.master), "the reaper did not close the client once the master answered again"
    deadline = time.monotonic() + 5  # the workers exit once their stuck calls returned
    while s._calls.workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s._calls.workers() == 0
    assert not GLOG_LINE.search(capfd.readouterr().err)


def test_killed_master_mid_use_is_unavailable_and_close_is_fast(master, buf, capfd):
    s = open_store(master, buf)
    kill(master)
    for op, call in every_call(s, buf).items():
        err, took, _ = timed(call)
        assert isinstance(err, StoreUnavailable), (op, err)
        assert re.match(rf"{op.replace('multi-', '')}: mooncake master at {master.master} unreachable", str(err)), err
        assert took < TIMEOUT + SLACK, (op, took)
    _, took, _ = timed(s.close)
    assert took < CONNECT + SLACK, took
    assert s.registered_buffers() == [] and reaper.pending(master.master) == 1
    with mooncake_master(ports=master.ports):  # back: the reaper closes the client
        assert reaped(master.master), "the reaper did not close the client once a master answered again"
    err = capfd.readouterr().err
    assert not GLOG_LINE.search(err), err[:2000]  # the wheel's glog is off by default


def test_master_restarted_in_place_is_used_again(buf):
    """The wheel's heartbeat reconnects to a master restarted on the same address and remounts
    this client's segment; values stored before are gone (the master keeps them in memory)."""
    with mooncake_master() as m:
        s = open_store(m, buf)
        kill(m)
    try:
        with pytest.raises(StoreUnavailable, match=f"mooncake master at {m.master} unreachable"):
            s.exists(["k"])
        with mooncake_master(ports=m.ports) as m2:
            assert m2.master == m.master
            deadline = time.monotonic() + 15
            while True:
                with contextlib.suppress(StoreError):
                    if s.put(["again"], [[(buf.ctypes.data, 4096)]])[0].ok:
                        break
                assert time.monotonic() < deadline, "the store did not recover within 15 s"
                time.sleep(0.1)
            assert s.exists(["k", "again"]) == [False, True]
            (r,) = s.get(["again"], [[(buf.ctypes.data + 8192, 4096)]])
            assert r.ok and np.array_equal(buf[8192:12288], buf[:4096])
            _, took, _ = timed(s.close)
            assert took < 5, took
            assert s.registered_buffers() == []
    finally:
        s.close()


def test_timeouts_are_validated():
    for bad in (0, -1.0, True, "5", 1e9):
        with pytest.raises(ValueError, match=r"timeout_s=.* is invalid \(need seconds in \(0, 3600\]\)"):
            create_store("mooncake", master="127.0.0.1:1", timeout_s=bad)

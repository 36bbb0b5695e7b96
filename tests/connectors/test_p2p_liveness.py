"""The p2p side channel notices a dead peer within about a second: a call to a port nothing listens
on fails fast, and loads waiting on a producer that died fail (recompute) instead of at their deadline."""

from __future__ import annotations

import socket
import time

import pytest

from hwkv.connectors.p2p.channel import ChannelError, SideChannel, call, listening
from hwkv.connectors.p2p.consumer import Consumer, LoadSpec, _Load
from hwkv.connectors.p2p.protocol import Ack, Release

pytestmark = pytest.mark.timeout(30)


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def test_a_call_to_a_dead_peer_fails_in_about_a_second_not_its_timeout():
    addr = f"127.0.0.1:{dead_port()}"
    assert not listening(addr)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="is down"):
        call(addr, Release("r", False), timeout_s=20.0)
    assert time.monotonic() - t0 < 2.0
    slow = SideChannel("127.0.0.1", 0, lambda msg: (time.sleep(1.2), Ack(True))[1])  # alive, just slow
    try:
        assert listening(slow.address)
        assert isinstance(call(slow.address, Release("r", False), timeout_s=5.0), Ack)  # probes do not fail it
    finally:
        slow.close()


def test_loads_waiting_on_a_dead_producer_fail_at_once():
    port = dead_port()
    done: list[tuple] = []

    class Probing(Consumer):
        def __init__(self):
            spec = LoadSpec("req-1", {"remote_host": "127.0.0.1", "remote_port": port}, [1, 2], 0, 32)
            self._reading = {"req-1": _Load(spec, deadline=time.monotonic() + 90)}
            self._probed = {}

        def _done(self, kind, rid, ok, nbytes, settled=True):
            done.append((kind, rid, ok))

    c = Probing()
    t0 = time.monotonic()
    c._probe_producers(time.monotonic())
    while not done:
        assert time.monotonic() - t0 < 5, "the dead producer was not noticed"
        time.sleep(0.02)
    assert done == [("recv", "req-1", False)] and time.monotonic() - t0 < 2.0

"""tcp staging's host mirror: pinned when allocated where tcp is the engine's first protocol; behind a
device-direct protocol (tcp only as the fallback) plain untouched host memory, pinned in place once,
when a peer first falls back (a device that cannot pin in place gets it pinned up front)."""

from __future__ import annotations

import threading

import pytest
import torch

from hwkv.connectors.p2p import P2PConnector
from hwkv.connectors.p2p.worker import P2PWorker
from hwkv.interfaces import KVCache, KVCacheSpec, KVLayoutKind


class _Device:
    type, async_copies = "fake", True

    def __init__(self, in_place: bool):
        self.pins_host_in_place = in_place
        self.pinned: list[int] = []
        self.eager = 0

    def pin_host_memory(self, t: torch.Tensor) -> None:
        self.pinned.append(t.data_ptr())

    def allocate_kv_cache(self, spec, layout, host=False):
        assert host
        self.eager += 1
        return KVCache.allocate(spec, layout, "cpu")


@pytest.fixture
def kv():
    return KVCache.allocate(KVCacheSpec(2, 8, 16, 2, 8, torch.float32), KVLayoutKind.SEPARATE_KV, "cpu")


def _connector(dev: _Device) -> P2PWorker:
    c = P2PConnector(role="producer").worker
    c.bind_device(dev)
    return c


def test_fallback_mirror_is_pinned_once_at_first_use(kv):
    dev = _Device(in_place=True)
    c = _connector(dev)
    try:
        mirror = c._mirror(kv, fallback=True)
        assert dev.eager == 0 and not dev.pinned
        assert [t.shape for t in mirror.tensors] == [t.shape for t in kv.tensors]
        threads = [threading.Thread(target=c._pin_mirror) for _ in range(4)]
        c.host_kv = mirror
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(dev.pinned) == sorted(t.data_ptr() for t in mirror.tensors)  # each tensor once
        c._pin_mirror()
        assert len(dev.pinned) == len(mirror.tensors)
    finally:
        c.shutdown()


@pytest.mark.parametrize("fallback, in_place", [(False, True), (True, False)], ids=["tcp-first", "no-in-place"])
def test_mirror_is_pinned_up_front_otherwise(kv, fallback, in_place):
    dev = _Device(in_place=in_place)
    c = _connector(dev)
    try:
        c.host_kv = c._mirror(kv, fallback=fallback)
        c._pin_mirror()
        assert dev.eager == 1 and not dev.pinned
    finally:
        c.shutdown()


def test_a_device_that_cannot_pin_in_place_says_so():
    from types import SimpleNamespace

    from hwkv.interfaces.device import Device

    with pytest.raises(NotImplementedError, match="cannot be pinned in place"):
        Device.pin_host_memory(SimpleNamespace(type="npu", async_copies=True), torch.empty(4))
    Device.pin_host_memory(SimpleNamespace(type="cpu", async_copies=False), torch.empty(4))  # the host: nothing to do

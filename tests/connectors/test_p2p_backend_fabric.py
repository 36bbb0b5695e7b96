"""p2p on a backend's own device fabric (Ascend's ``ascend``/HCCS, ``rdma``): the endpoint comes from
``Backend.create_transfer`` (which names the device: Mooncake's ``device_name`` is the NPU id on
Ascend) and the KV is registered through the backend's ``register_kv_cache`` where it has one (HCCL
holds at most 256 regions per process). No NPU or RDMA NIC here: the backend, its endpoint and a KV
cache "on the device" are stand-ins around a real CPU cache, so the connector's glue is what runs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hwkv.connectors.p2p.state import DriverState, P2PConfig
from hwkv.connectors.p2p.worker import P2PWorker
from hwkv.interfaces import KVCacheSpec, KVLayoutKind
from hwkv.reference import CpuDevice


class _Endpoint:
    def __init__(self, **options):
        self.options, self.regions, self.closed = options, [], False

    def register(self, ptr: int, nbytes: int) -> None:
        self.regions.append((ptr, nbytes))

    def endpoint(self) -> str:
        return "127.0.0.1:1"

    def close(self) -> None:
        self.closed = True


class _Backend:
    """Declares ``protocols`` like a device backend; records what the connector asks of it."""

    def __init__(self, protocols: tuple[str, ...], merge: bool):
        self.capabilities = SimpleNamespace(transfer_protocols=protocols, transfer_reason="")
        self.made: list[_Endpoint] = []
        if merge:
            self.register_kv_cache = self._register

    def create_transfer(self, **options) -> _Endpoint:
        options.setdefault("device_name", "3")  # what AscendBackend does: its NPU's index
        self.made.append(_Endpoint(**options))
        return self.made[-1]

    def _register(self, endpoint: _Endpoint, kv_cache) -> list[tuple[int, int]]:
        lo = min(t.data_ptr() for t in kv_cache.tensors)
        hi = max(t.data_ptr() + t.numel() * t.element_size() for t in kv_cache.tensors)
        endpoint.register(lo, hi - lo)  # one arena, one region
        return [(lo, hi - lo)]


class _OnDevice:
    """A real CPU KV cache that says it lives on an NPU (the connector keeps device protocols for it)."""

    def __init__(self, kv):
        self._kv, self.device = kv, SimpleNamespace(type="npu")

    def __getattr__(self, name):
        return getattr(self._kv, name)


def _worker(backend, **cfg) -> P2PWorker:
    w = P2PWorker(P2PConfig("consumer", **cfg), DriverState())
    w.bind_backend(backend)
    return w


def _kv() -> _OnDevice:
    spec = KVCacheSpec(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    return _OnDevice(CpuDevice().allocate_kv_cache(spec, KVLayoutKind.PER_LAYER))


@pytest.mark.parametrize("device_name", ["", "7"])
def test_a_fabric_protocol_takes_the_backends_endpoint_and_registration(device_name):
    b = _Backend(("ascend",), merge=True)
    w = _worker(b, device_name=device_name, transfer_timeout_s=4.0)
    try:
        w.register_kv_caches(_kv())
        (t,) = b.made
        assert t.options == {"protocol": "ascend", "host": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                             "timeout_s": 4.0, "device_name": device_name or "3"}
        assert len(t.regions) == 1  # the backend's merged region, not one per KV tensor
        assert w.protocol == "ascend" and w.layout.protocol == "ascend" and w.layout.endpoint == "127.0.0.1:1"
    finally:
        w.shutdown()
    assert t.closed


def test_without_a_backend_registration_every_tensor_is_registered():
    b = _Backend(("rdma",), merge=False)
    w = _worker(b)
    try:
        kv = _kv()
        w.register_kv_caches(kv)
        (t,) = b.made
        assert t.options["protocol"] == "rdma" and t.options["device_name"] == "3"
        assert t.regions == [(x.data_ptr(), x.numel() * x.element_size()) for x in kv.tensors]
    finally:
        w.shutdown()


def test_kv_cache_groups_register_each_groups_cache_through_the_backend():
    """KV-cache groups (docs/hybrid-models.md): the backend's registration gets each group's cache (one
    merged region per group: the groups' tensors are separate allocations), and the layout lists them."""
    from hwkv.core.kv_groups import KVCacheGroup
    from hwkv.engine.kv_groups import GroupedKVCache

    spec = KVCacheSpec(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    groups = (KVCacheGroup((2,), None, 4), KVCacheGroup((0, 1), 16, 3))
    kv = _OnDevice(GroupedKVCache.allocate(groups, spec, CpuDevice(), KVLayoutKind.PER_LAYER))
    b = _Backend(("ascend",), merge=True)
    w = _worker(b)
    try:
        w.register_kv_caches(kv)
        (t,) = b.made
        assert len(t.regions) == 2
        assert [(g.window, g.layers, g.num_blocks, g.tensors) for g in w.layout.groups] == [(0, [2], 4, 1),
                                                                                            (16, [0, 1], 3, 2)]
        assert w.layout.bases == [x.data_ptr() for x in kv.tensors] and w.layout.group(1).num_layers == 2
    finally:
        w.shutdown()

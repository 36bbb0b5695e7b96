"""HCCS registration: one region for an arena-allocated cache, merging per storage, HCCL's 256
region limit, all-or-nothing registration."""

from __future__ import annotations

import pytest
import torch

from hwkv.interfaces import KVCache, KVCacheSpec, KVLayoutKind


class FakeEndpoint:
    """Records register/unregister like a Transfer; ``fail_at`` makes the n-th register raise."""

    def __init__(self, fail_at: int | None = None, existing: int = 0):
        self.regs = {i + 1: 1 for i in range(existing)}  # pre-existing registrations (fake ptrs)
        self.fail_at, self.calls = fail_at, 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("register_memory failed with code -1")
        self.regs[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.regs[ptr]

    def registered_buffers(self) -> list[tuple[int, int]]:
        return list(self.regs.items())


def spec(layers=3, blocks=5):
    return KVCacheSpec(layers, blocks, 128, 2, 64, torch.float16)


def test_transfer_cache_is_one_aligned_region(npu):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend(transfer=True)
    cache = backend.device.allocate_kv_cache(spec(), KVLayoutKind.SEPARATE_KV)
    assert len(cache.tensors) == 6 and len({t.untyped_storage().data_ptr() for t in cache.tensors}) == 1
    assert all(t.data_ptr() % (2 << 20) == 0 and t.is_contiguous() and not bool(t.any()) for t in cache.tensors)
    ep = FakeEndpoint()
    ((ptr, nbytes),) = backend.register_kv_cache(ep, cache)
    assert ptr == cache.tensors[0].data_ptr() and ptr % (2 << 20) == 0
    last = cache.tensors[-1]
    assert ptr + nbytes == last.data_ptr() + last.numel() * last.element_size()
    for t in cache.tensors:  # every tensor's bytes lie in the region (transfer checks exactly this)
        assert ptr <= t.data_ptr() and t.data_ptr() + t.numel() * 2 <= ptr + nbytes
    # writes to one tensor never touch another (views of one arena, disjoint)
    cache.tensors[2].fill_(1)
    assert sum(int(t.count_nonzero()) for t in cache.tensors) == cache.tensors[2].numel()


def test_separately_allocated_tensors_are_one_region_each(npu):
    from hwkv_ascend.backend import AscendBackend
    from hwkv_ascend.registration import unregister_kv_cache

    backend = AscendBackend()  # no transfer: plain per-tensor allocations
    cache = backend.device.allocate_kv_cache(spec(), KVLayoutKind.SEPARATE_KV)
    ep = FakeEndpoint()
    regions = backend.register_kv_cache(ep, cache)
    assert sorted(regions) == sorted((t.data_ptr(), t.numel() * 2) for t in cache.tensors)
    unregister_kv_cache(ep, regions)
    assert ep.regs == {}


def test_views_of_one_storage_merge_within_the_gap():
    from hwkv_ascend.registration import merged_regions

    raw = torch.zeros(64 * 1024, dtype=torch.uint8)
    base = raw.data_ptr()
    a, b, c = raw[0:1000], raw[1000 + 4096 : 9000], raw[9000 + 4097 : 20000]  # gaps 4096, 4097
    other = torch.zeros(100, dtype=torch.uint8)
    got = merged_regions([c, a, other, b])
    assert (base, 9000) in got and (base + 9000 + 4097, 20000 - 9000 - 4097) in got
    assert (other.data_ptr(), 100) in got and len(got) == 3
    assert merged_regions([a, b, c], gap=1 << 20) == [(base, 20000)]
    with pytest.raises(ValueError, match="not contiguous"):
        merged_regions([torch.zeros(4, 4).t()])


def test_more_than_256_regions_is_refused_before_registering(npu):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    s = KVCacheSpec(130, 1, 128, 1, 64, torch.float16)  # 260 separately allocated tensors
    cache = KVCache(s, KVLayoutKind.SEPARATE_KV,
                    [torch.zeros(sh, dtype=s.dtype) for sh in s.tensor_shapes(KVLayoutKind.SEPARATE_KV)])
    ep = FakeEndpoint()
    with pytest.raises(ValueError, match=r"260 registered regions \(260 tensors, .*more than the 256 HCCL allows"):
        backend.register_kv_cache(ep, cache)
    assert ep.calls == 0
    small = backend.device.allocate_kv_cache(spec(), KVLayoutKind.SEPARATE_KV)  # 6 regions
    with pytest.raises(ValueError, match="and 251 are registered already"):
        backend.register_kv_cache(FakeEndpoint(existing=251), small)
    assert len(backend.register_kv_cache(FakeEndpoint(existing=250), small)) == 6


def test_a_failed_registration_releases_the_ones_made(npu):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    cache = backend.device.allocate_kv_cache(spec(), KVLayoutKind.SEPARATE_KV)
    ep = FakeEndpoint(fail_at=4)
    with pytest.raises(RuntimeError, match="register_memory failed"):
        backend.register_kv_cache(ep, cache)
    assert ep.regs == {} and ep.calls == 4


def test_store_endpoints_register_buffers(npu):
    from hwkv_ascend.backend import AscendBackend

    class Store:
        def __init__(self):
            self.regs = {}

        def register_buffer(self, ptr, nbytes):
            self.regs[ptr] = nbytes

        def unregister_buffer(self, ptr):
            del self.regs[ptr]

    backend = AscendBackend(transfer=True)
    cache = backend.device.allocate_kv_cache(spec(), KVLayoutKind.SEPARATE_KV)
    st = Store()
    regions = backend.register_kv_cache(st, cache)
    assert len(regions) == 1 and list(st.regs.items()) == regions


def test_hccs_transfer_refuses_the_257th_region(monkeypatch):
    """Core's Mooncake endpoint with HCCL's limit, on a stand-in engine (no Mooncake needed)."""
    import sys
    import types

    from hwkv_ascend.registration import MAX_REGIONS, HccsTransfer

    from hwkv.interfaces import TransferError

    class Engine:
        def initialize(self, *args):
            self.args = args
            return 0

        def get_rpc_port(self):
            return 17001

        def register_memory(self, ptr, nbytes):
            return 0

        def unregister_memory(self, ptr):
            return 0

    fake = types.ModuleType("mooncake.engine")
    fake.TransferEngine = Engine
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", fake)
    t = HccsTransfer(protocol="ascend", device_name="0")
    assert t._engine.args[2:] == ("ascend", "0")
    buf = torch.zeros((MAX_REGIONS + 1) * 64, dtype=torch.uint8)
    for i in range(MAX_REGIONS):
        t.register(buf.data_ptr() + 64 * i, 64)
    with pytest.raises(TransferError, match="256 regions are registered already, the most HCCL allows"):
        t.register(buf.data_ptr() + 64 * MAX_REGIONS, 64)
    assert len(t.registered_buffers()) == MAX_REGIONS
    t.unregister(buf.data_ptr())
    t.register(buf.data_ptr() + 64 * MAX_REGIONS, 64)
    t.close()

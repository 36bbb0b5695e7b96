"""CudaDevice.pin_host_memory: plain host memory page-locked in place (cudaHostRegister) serves the
device's block copies as pinned memory does, and is unregistered when freed (tcp staging's fallback
mirror, pinned at the first peer that falls back)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pinned_in_place_copies_blocks_both_ways():
    from hwkv_cuda.device import CudaDevice

    from hwkv.interfaces import KVCache, KVCacheSpec, KVLayoutKind

    dev, layout = CudaDevice(0), KVLayoutKind.SEPARATE_KV
    spec = KVCacheSpec(2, 8, 16, 2, 64, torch.bfloat16)
    gpu = dev.allocate_kv_cache(spec, layout)
    for t in gpu.tensors:
        t.copy_(torch.randn(t.shape, dtype=t.dtype))
    want = [t.cpu() for t in gpu.tensors]
    host = KVCache(spec, layout, [torch.empty(s, dtype=spec.dtype) for s in spec.tensor_shapes(layout)])
    assert not any(t.is_pinned() for t in host.tensors)
    for t in host.tensors:
        dev.pin_host_memory(t)
        dev.pin_host_memory(t)  # again: nothing to do
    assert all(t.is_pinned() for t in host.tensors)
    every = [(i, i) for i in range(spec.num_blocks)]
    dev.copy_blocks(gpu, host, every)  # device -> mirror
    torch.cuda.synchronize()
    assert all(torch.equal(h, w) for h, w in zip(host.tensors, want))
    for t in gpu.tensors:
        t.zero_()
    dev.copy_blocks(host, gpu, every)  # mirror -> device
    torch.cuda.synchronize()
    assert all(torch.equal(g.cpu(), w) for g, w in zip(gpu.tensors, want))
    del host
    gc.collect()  # the finalizer unregisters; a leaked registration would make the next one fail
    again = torch.empty(1 << 20, dtype=torch.uint8)
    dev.pin_host_memory(again)
    assert again.is_pinned()


def test_device_tensors_are_refused():
    from hwkv_cuda.device import CudaDevice

    with pytest.raises(ValueError, match="allowed: host tensors"):
        CudaDevice(0).pin_host_memory(torch.empty(4, device="cuda"))

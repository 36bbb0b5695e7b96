"""Device and KV layout: allocation, block byte segments, block copies device↔host and in-device."""

from __future__ import annotations

import pytest
import torch

from conformance.harness import new_cache, randn
from conformance.report import not_supported
from hwkv.interfaces import KVCache, KVCacheSpec

pytestmark = pytest.mark.capability("device")
NUM_BLOCKS = 9


def _spec(caps, block_size, dtype=None, num_layers=3):
    return KVCacheSpec(num_layers, NUM_BLOCKS, block_size, 2, 64 if caps.head_sizes is None or 64 in caps.head_sizes
                       else caps.head_sizes[0], dtype or caps.dtypes[0])


def _require(caps, spec):
    reasons = caps.validate(spec)
    if reasons:
        not_supported(reasons)


def _fill(kv: KVCache, gen: torch.Generator) -> None:
    for t in kv.tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))


def test_memory_info(backend):
    free, total = backend.device.memory_info()
    assert 0 < free <= total, f"memory_info() = ({free}, {total}): need 0 < free <= total"
    assert backend.device.description(), "description() must name the device"


def test_allocate_kv_cache(backend, check, dtype, block_size):
    caps = backend.capabilities
    spec = _spec(caps, block_size, dtype)
    _require(caps, spec)
    layout = backend.attention.kv_layout
    assert layout in caps.kv_layouts, f"attention layout {layout.value} not among declared {caps.kv_layouts}"
    for host in (False, True):
        kv = backend.device.allocate_kv_cache(spec, layout, host=host)
        where = "host" if host else "device"
        want_dev = "cpu" if host else backend.device.torch_device.type
        assert kv.layout is layout and kv.spec == spec
        assert [tuple(t.shape) for t in kv.tensors] == spec.tensor_shapes(layout), f"{where} cache shapes"
        for t in kv.tensors:
            assert t.is_contiguous() and t.dtype == dtype and t.device.type == want_dev, f"{where} cache tensor"
            check.exact(t, torch.zeros_like(t), "copy_blocks", f"{where} cache must be zero-filled")


@pytest.mark.parametrize("blocks", [[0], [3, 4, 5], [7, 2, 3, 8, 0], list(range(NUM_BLOCKS))],
                         ids=["one", "run", "scattered", "all"])
def test_layout_segments(backend, block_size, blocks):
    """Segments cover exactly the bytes of the requested blocks, in every tensor, once."""
    caps = backend.capabilities
    spec = _spec(caps, block_size)
    _require(caps, spec)
    kv = new_cache(backend, spec)
    segs = kv.segments(blocks)
    assert sum(s.nbytes for s in segs) == len(blocks) * spec.bytes_per_block, "segments must total the blocks' bytes"
    for ti, t in enumerate(kv.tensors):
        nbytes = t.numel() * t.element_size()
        per_block = nbytes // NUM_BLOCKS
        assert per_block * NUM_BLOCKS == nbytes and kv.block_nbytes(ti) == per_block, "tensors must be block-major"
        cover = torch.zeros(nbytes, dtype=torch.int32)
        for s in (s for s in segs if s.tensor == ti):
            assert s.offset >= 0 and s.offset + s.nbytes <= nbytes, f"segment {s} outside tensor {ti}"
            cover[s.offset : s.offset + s.nbytes] += 1
        want = torch.zeros(NUM_BLOCKS, per_block, dtype=torch.int32)
        want[blocks] = 1
        assert torch.equal(cover, want.reshape(-1)), f"tensor {ti}: segments do not cover exactly blocks {blocks}"
    addrs = kv.addresses(blocks)
    assert addrs == [(kv.tensors[s.tensor].data_ptr() + s.offset, s.nbytes) for s in segs]


def test_write_kv_stays_in_block(backend, gen, block_size):
    """Writing one token of one layer changes bytes only inside that block's segments."""
    caps = backend.capabilities
    spec = _spec(caps, block_size)
    _require(caps, spec)
    dev = backend.device.torch_device
    kv = new_cache(backend, spec, fill=gen)
    impl = backend.attention.make_impl(2, spec.head_size, 2, spec.head_size**-0.5)
    block, layer = NUM_BLOCKS - 3, 1
    before = [t.cpu().reshape(-1).view(torch.uint8).clone() for t in kv.tensors]
    k = randn(gen, 1, 2, spec.head_size, dtype=spec.dtype).to(dev) + 100  # surely differs from the fill
    slot = torch.tensor([block * block_size + block_size - 1], device=dev)
    impl.write_kv(k, k + 1, kv.layer(layer), slot)
    backend.device.synchronize()
    inside = torch.zeros(sum(b.numel() for b in before), dtype=torch.bool)
    base = 0
    starts = []
    for b in before:
        starts.append(base)
        base += b.numel()
    for s in kv.segments([block]):
        inside[starts[s.tensor] + s.offset : starts[s.tensor] + s.offset + s.nbytes] = True
    changed = torch.cat([t.cpu().reshape(-1).view(torch.uint8) != b for t, b in zip(kv.tensors, before)])
    assert bool(changed.any()), "write_kv changed no byte of the cache"
    assert not bool((changed & ~inside).any()), "write_kv changed bytes outside the target block's segments"


@pytest.mark.parametrize("direction", ["device_to_host", "host_to_device", "device_to_device", "in_place"])
@pytest.mark.parametrize("on_stream", [False, True], ids=["default_stream", "side_stream"])
def test_copy_blocks(backend, check, gen, dtype, direction, on_stream):
    caps = backend.capabilities
    spec = _spec(caps, caps.default_block_size, dtype)
    _require(caps, spec)
    dev, layout = backend.device, backend.attention.kv_layout
    src = dev.allocate_kv_cache(spec, layout, host=direction == "host_to_device")
    _fill(src, gen)
    dev.synchronize()  # the fill ran on the current stream; the copy may run on another
    if direction == "in_place":
        dst = src
        pairs = [(0, 5), (2, 6), (1, 8)]  # sources untouched by the copy
    else:
        dst = dev.allocate_kv_cache(spec, layout, host=direction == "device_to_host")
        pairs = [(3, 0), (1, 5), (7, 2), (8, 3), (4, 4)]  # out of order, a run, identity
    expect = [t.cpu().clone() for t in dst.tensors]
    for t_exp, t_src in zip(expect, src.tensors):
        for s, d in pairs:
            t_exp[d] = t_src[s].cpu()
    if on_stream:
        stream, event = dev.new_stream(), dev.new_event()
        dev.copy_blocks(src, dst, pairs, stream=stream)
        event.record(stream)
        event.synchronize()
        assert event.query(), "event recorded after copy_blocks must be complete after synchronize()"
    else:
        dev.copy_blocks(src, dst, pairs)
        dev.synchronize()
    for i, (got, want) in enumerate(zip(dst.tensors, expect)):
        check.exact(got.cpu(), want, "copy_blocks", f"tensor {i} after copy_blocks {direction}")
    with pytest.raises((IndexError, ValueError)):
        dev.copy_blocks(src, dst, [(0, NUM_BLOCKS)])
    with pytest.raises(ValueError):  # contract: destinations distinct (copies run in parallel)
        dev.copy_blocks(src, dst, [(1, 6), (2, 6)])
    if direction == "in_place":
        with pytest.raises(ValueError):  # contract: within one cache no block is source and destination
            dev.copy_blocks(src, dst, [(1, 2), (2, 3)])

"""Device and KV layout: allocation, block byte segments, block copies device↔host and in-device."""

from __future__ import annotations

import dataclasses
import gc
import time

import pytest
import torch

from conformance.harness import new_cache, randn, read_tokens
from conformance.report import not_supported
from hwkv.interfaces import KVCache, KVCacheSpec

pytestmark = pytest.mark.capability("device")
NUM_BLOCKS = 9
# production-size copies: an 8k-token prompt offloads 512 blocks at block size 16; 300 pairs is past
# 256 and a multiple of no launch chunk (a kernel that drops the pairs after its last full chunk fails)
COPY_BLOCKS, COPY_PAIRS, RUN = 1024, 300, 16
HOST_EXTRA = 64  # a host tier larger than the device pool (caches may differ in num_blocks only)
MEM_PROBE = 512 << 20  # bytes allocated by the memory_info check (larger than any earlier cache)


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


@pytest.mark.serial  # reads device-wide free memory: no other test may allocate meanwhile
def test_memory_info_tracks_allocations(backend):
    """``memory_info`` is what the engine sizes its KV pool from: allocating a KV cache of N bytes
    lowers ``free`` by about N, and after freeing it another N-byte cache costs nothing more (the
    memory went back to the device or to the backend's allocator cache). A host's free memory is
    shared with every other process and, in a VM, moves with free-page reporting (pages isolated for
    seconds after a free), so the bounds are wide — a drop within [N/4, 3N/2] and at most N/2 more
    after a free and a reallocation, in one of five attempts — yet a static value, wrong units, used
    memory returned as free, total returned as free or frees that never show all miss them."""
    dev, caps = backend.device, backend.capabilities
    free, total = dev.memory_info()
    spec1 = _spec(caps, caps.default_block_size, num_layers=1)
    size = min(MEM_PROBE, free // 4) // spec1.bytes_per_block * spec1.bytes_per_block
    spec = KVCacheSpec(1, size // spec1.bytes_per_block, spec1.block_size, spec1.num_kv_heads, spec1.head_size,
                       spec1.dtype)
    _require(caps, spec)
    seen = []
    for _ in range(5):
        gc.collect()
        time.sleep(0.2)
        f0 = dev.memory_info()[0]
        kv = dev.allocate_kv_cache(spec, backend.attention.kv_layout)
        dev.synchronize()
        f1 = dev.memory_info()[0]
        del kv
        gc.collect()
        dev.synchronize()
        kv = dev.allocate_kv_cache(spec, backend.attention.kv_layout)
        dev.synchronize()
        f2 = dev.memory_info()[0]
        del kv
        gc.collect()
        seen.append((f0 - f1, f1 - f2))
        if 0.25 * size <= f0 - f1 <= 1.5 * size and f1 - f2 <= 0.5 * size:
            return
    raise AssertionError(
        f"memory_info does not track a {size / 2**20:.0f} MiB KV cache: (drop on allocation, further drop "
        f"after free + reallocation) in MiB = {[(round(a / 2**20), round(b / 2**20)) for a, b in seen]}; "
        f"expected a drop in [{size / 2**22:.0f}, {1.5 * size / 2**20:.0f}] and at most {size / 2**21:.0f} more"
    )


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


@pytest.mark.parametrize("size", ["small", "4MiB"])
def test_host_staging(backend, check, gen, dtype, size):
    """``host_empty`` gives host buffers (page-locked with ``async_copies``); ``to_device`` puts a host
    tensor on the device unchanged; ``to_host_async`` brings it back, valid once its event fired, as a copy (a
    later write to the device tensor leaves it alone)."""
    dev = backend.device
    shape = (3, 5) if size == "small" else (1024, 1024 * 4 // torch.empty((), dtype=dtype).element_size())
    buf = dev.host_empty(shape, dtype)
    assert buf.device.type == "cpu" and tuple(buf.shape) == shape and buf.dtype == dtype, "host_empty"
    if getattr(dev, "async_copies", False):
        assert buf.is_pinned(), "host_empty must be page-locked when the device copies asynchronously"
    buf.copy_(randn(gen, *shape, dtype=dtype))
    on = dev.to_device(buf)
    assert on.device.type == dev.torch_device.type and on.dtype == dtype, f"to_device gave {on.device}, {on.dtype}"
    src = on * 1  # a fresh device tensor, as the engine's outputs are
    back, event = dev.to_host_async(src)
    if event is not None:
        event.synchronize()
    assert back.device.type == "cpu", "to_host_async must return a host tensor"
    src.zero_()  # a graph's static output, rewritten by its next replay: the host copy must not follow
    check.exact(back, buf, "copy_blocks", f"{size} {dtype} through to_device / to_host_async")
    # (3.2) a strided view with a storage offset (a column slice of a step's outputs): its elements,
    # not the storage bytes after its first one
    back, event = dev.to_host_async((on * 1)[1:, 1::2])
    if event is not None:
        event.synchronize()
    check.exact(back, buf[1:, 1::2], "copy_blocks", f"{size} {dtype} strided view [1:, 1::2] through to_host_async")


def _copy_pairs(gen: torch.Generator, in_place: bool, n_src: int, n_dst: int) -> list[tuple[int, int]]:
    """COPY_PAIRS pairs: a run consecutive on both sides (copies that merge) among shuffled scattered
    pairs over each cache's whole range; in place, sources and destinations are disjoint (the contract)."""
    pick = lambda lo, hi, n: (lo + torch.randperm(hi - lo, generator=gen)[:n]).tolist()
    rest = COPY_PAIRS - RUN
    if in_place:
        src, dst = pick(COPY_PAIRS + RUN, COPY_BLOCKS, rest), pick(RUN, COPY_PAIRS, rest)
    else:  # a source may repeat across caches and a block may copy onto itself
        src, dst = pick(0, n_src, rest), pick(RUN, n_dst, rest)
    pairs = list(zip(src, dst))
    at = rest // 2
    return pairs[:at] + [(COPY_PAIRS + i, i) for i in range(RUN)] + pairs[at:]


@pytest.mark.parametrize("direction", ["device_to_host", "host_to_device", "device_to_device", "in_place"])
@pytest.mark.parametrize("on_stream", [False, True], ids=["default_stream", "side_stream"])
def test_copy_blocks(backend, check, gen, dtype, direction, on_stream):
    caps = backend.capabilities
    spec = _spec(caps, caps.default_block_size, dtype, num_layers=2)
    spec = KVCacheSpec(spec.num_layers, COPY_BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)
    _require(caps, spec)
    dev, layout = backend.device, backend.attention.kv_layout
    # the host side is a larger tier, as the offload connector's (caches may differ in num_blocks)
    host_spec = dataclasses.replace(spec, num_blocks=COPY_BLOCKS + HOST_EXTRA)
    src_host, dst_host = direction == "host_to_device", direction == "device_to_host"
    src = dev.allocate_kv_cache(host_spec if src_host else spec, layout, host=src_host)
    _fill(src, gen)
    dev.synchronize()  # the fill ran on the current stream; the copy may run on another
    dst = src if direction == "in_place" else dev.allocate_kv_cache(host_spec if dst_host else spec, layout,
                                                                     host=dst_host)
    pairs = _copy_pairs(gen, direction == "in_place", src.spec.num_blocks, dst.spec.num_blocks)
    expect = [t.cpu().clone() for t in dst.tensors]
    for t_exp, t_src in zip(expect, src.tensors):
        s_idx, d_idx = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
        t_exp[d_idx] = t_src.cpu()[s_idx]
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
        check.exact(got.cpu(), want, "copy_blocks", f"tensor {i} after copy_blocks {direction} of {len(pairs)} pairs")
    with pytest.raises((IndexError, ValueError)):
        dev.copy_blocks(src, dst, [(0, dst.spec.num_blocks)])
    with pytest.raises((IndexError, ValueError)):
        dev.copy_blocks(src, dst, [(src.spec.num_blocks, 0)])
    with pytest.raises(ValueError):  # contract: destinations distinct (copies run in parallel)
        dev.copy_blocks(src, dst, [(1, 6), (2, 6)])
    if direction == "in_place":
        with pytest.raises(ValueError):  # contract: within one cache no block is source and destination
            dev.copy_blocks(src, dst, [(1, 2), (2, 3)])


@pytest.mark.parametrize("direction", ["device_to_host", "host_to_device"])
def test_copy_blocks_fp8(backend, check, gen, direction):
    """(3.2) ``copy_blocks`` of an fp8 (1-byte) KV cache, where ``"fp8_e4m3"`` is declared: the offload
    tier copies those too (a copy that handles only the 2-byte dtypes left the host tier empty). Bytes
    compared exactly, every code (NaN codes included) as written."""
    from hwkv.interfaces.kv_quant import FP8_E4M3

    caps = backend.capabilities
    if "fp8_e4m3" not in caps.kv_cache_dtypes:
        not_supported("fp8_e4m3 not in Capabilities.kv_cache_dtypes")
    spec = _spec(caps, caps.default_block_size, num_layers=2)
    spec = KVCacheSpec(spec.num_layers, COPY_BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_size, FP8_E4M3)
    dev, layout = backend.device, backend.attention.kv_layout
    src_host = direction == "host_to_device"
    src = dev.allocate_kv_cache(spec, layout, host=src_host)
    dst = dev.allocate_kv_cache(spec, layout, host=not src_host)
    for t in src.tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    for t in dst.tensors:
        t.view(torch.uint8).zero_()
    dev.synchronize()
    pairs = _copy_pairs(gen, False, COPY_BLOCKS, COPY_BLOCKS)
    dev.copy_blocks(src, dst, pairs)
    dev.synchronize()
    s_idx, d_idx = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    for i, (s_t, d_t) in enumerate(zip(src.tensors, dst.tensors)):
        want = torch.zeros_like(d_t.cpu().view(torch.uint8))
        want[d_idx] = s_t.cpu().view(torch.uint8)[s_idx]
        check.exact(d_t.cpu().view(torch.uint8), want, "copy_blocks", f"fp8 tensor {i} after copy_blocks {direction} "
                    f"of {len(pairs)} pairs (uint8 codes)")


# -- suite 3.0: the device runtime the engine's graph and copy paths rely on ------------------------
def _graphs(caps) -> None:
    if not caps.graph_capture:
        not_supported("Capabilities.graph_capture is False: the backend declares no graph capture")


def test_graph_replay_reads_inputs_in_place(backend, check, gen):
    """A captured graph (elementwise work and the backend's own ``write_kv`` of a decode batch)
    replayed after its inputs changed in place — new values, new slots — computes on the new
    contents every time and writes the outputs the capture returned; ``empty_cache`` while the graph
    is alive frees nothing it uses (a fresh allocation right after must not alias its memory)."""
    caps = backend.capabilities
    _graphs(caps)
    dev = backend.device
    on = dev.torch_device
    spec = _spec(caps, caps.default_block_size, caps.dtypes[0], num_layers=1)
    spec = dataclasses.replace(spec, num_blocks=64)
    kv = dev.allocate_kv_cache(spec, backend.attention.kv_layout)
    impl = backend.attention.make_impl(spec.num_kv_heads, spec.head_size, spec.num_kv_heads, spec.head_size**-0.5)
    n = 8
    x = torch.zeros(4099, device=on)
    w = torch.zeros(4099, device=on)
    k = torch.zeros(n, spec.num_kv_heads, spec.head_size, dtype=spec.dtype, device=on)
    slots = torch.full((n,), -1, dtype=torch.long, device=on)
    impl.write_kv(k, k, kv.layer(0), slots)  # warm-up outside the capture (lazy kernel state)
    y0 = x * w + 1
    dev.synchronize()

    def step():
        impl.write_kv(k, k + 1, kv.layer(0), slots)
        return x * w + 1

    graph, y = dev.capture_graph(step, dev.graph_pool(), dev.new_stream())
    del y0
    nslots = spec.num_blocks * spec.block_size
    for trial in range(3):
        xs, ws = randn(gen, 4099), randn(gen, 4099)
        ks = randn(gen, n, spec.num_kv_heads, spec.head_size, dtype=spec.dtype)
        sl = torch.randperm(nslots, generator=gen)[:n]
        sl[trial] = -1  # padding moves too
        x.copy_(xs.to(on))
        w.copy_(ws.to(on))
        k.copy_(ks.to(on))
        slots.copy_(sl.to(on))
        if trial == 1:
            dev.empty_cache()  # with the graph alive
            junk = torch.full((1 << 20,), 7.0, device=on)  # reuses whatever empty_cache released
        graph.replay()
        dev.synchronize()
        check.exact(y.cpu(), xs * ws + 1, "copy_blocks", f"graph output after replay {trial} with new inputs")
        kc, vc = read_tokens(kv, 0)
        keep = sl >= 0
        check.exact(kc[sl[keep]], ks[keep], "kv_write", f"graph write_kv, replay {trial}: K at the new slots")
        check.exact(vc[sl[keep]], (ks[keep].float() + 1).to(spec.dtype) if spec.dtype != torch.float32
                    else ks[keep] + 1, "kv_write", f"write_kv inside the graph, replay {trial}: V")
        if trial == 1:
            assert bool((junk == 7.0).all()), "a replay after empty_cache wrote into memory allocated since"
    del graph


def test_event_on_side_stream(backend, check, gen):
    """An event recorded on a stream that is not the current one marks that stream's work: after
    ``event.synchronize()`` (and after ``current_stream().wait_event``) the side stream's result is
    complete; ``query`` is True once it is. The side stream gets enough work to still be running."""
    dev = backend.device
    on = dev.torch_device
    a = randn(gen, 1024, 1024).to(on)
    side = dev.new_stream()
    ev = dev.new_event()
    dev.synchronize()
    with dev.stream_context(side):
        y = a.clone()
        for _ in range(24):
            y = (y @ a).mul_(1.0 / 32)
        z = y.sum()
    ev.record(side)
    dev.current_stream().wait_event(ev)
    after_wait = (z * 1).cpu()  # ordered behind the event on the current stream
    ev.synchronize()
    assert ev.query(), "event.query() must be True after event.synchronize()"
    final = z.cpu()
    check.exact(after_wait, final, "copy_blocks", "a read ordered behind wait_event(event recorded on a side stream)")
    y2 = a.clone()
    for _ in range(24):
        y2 = (y2 @ a).mul_(1.0 / 32)
    check.close(final.reshape(1), y2.sum().cpu().reshape(1), torch.float32, "attention",
                "side-stream result read after event.synchronize()")


def _side_work(dev, a: torch.Tensor, side) -> torch.Tensor:
    """Enough work on ``side`` to still be running when the host moves on; returns its scalar result."""
    with dev.stream_context(side):
        y = a.clone()
        for _ in range(24):
            y = (y @ a).mul_(1.0 / a.shape[0] ** 0.5)
        return y.sum()


def test_stream_ordering_clauses(backend, check, gen):
    """The other orderings the engine relies on besides ``wait_event`` (suite 3.2): a read behind
    ``current_stream().wait_stream(side)`` sees the side stream's work; so does a read after
    ``Device.synchronize()`` (every stream, not only the current one); ``Event.query()`` True means
    the work before the record is complete (a read right then sees it); a re-recorded event marks
    the work before its LAST record. Each read is compared with the same tensor read once everything
    is synchronized. Vendor bugs: ``wait_stream`` a no-op, ``synchronize`` of the current stream only,
    ``query`` True once recorded, an event that keeps its first record."""
    dev = backend.device
    n = 256 if dev.torch_device.type == "cpu" else 1024  # a host "stream" runs at once: no need to be slow
    a = randn(gen, n, n).to(dev.torch_device)
    side = dev.new_stream()
    dev.synchronize()

    def settled(z: torch.Tensor) -> torch.Tensor:
        side.synchronize()
        dev.synchronize()
        return z.cpu()

    z = _side_work(dev, a, side)
    dev.current_stream().wait_stream(side)
    early = (z * 1).cpu()
    check.exact(early, settled(z), "copy_blocks", "a read ordered behind current_stream().wait_stream(side)")
    y2 = a.clone()
    for _ in range(24):
        y2 = (y2 @ a).mul_(1.0 / a.shape[0] ** 0.5)
    check.close(early.reshape(1), y2.sum().cpu().reshape(1), torch.float32, "attention",
                "side-stream result read behind wait_stream")

    z = _side_work(dev, a, side)
    dev.synchronize()
    early = z.cpu().clone()  # a copy: on the host .cpu() is the tensor itself
    check.exact(early, settled(z), "copy_blocks", "a side stream's result read after Device.synchronize()")

    ev = dev.new_event()
    z = _side_work(dev, a, side)
    ev.record(side)
    if ev.query():  # done already: a read now must see the work (query may also be False: then wait)
        early = z.cpu().clone()
        check.exact(early, settled(z), "copy_blocks", "a read right after event.query() returned True")
    ev.synchronize()
    assert ev.query(), "event.query() must be True after event.synchronize()"

    z = _side_work(dev, a, side)
    ev.record(side)  # the same event, recorded again: it now marks this work
    dev.current_stream().wait_event(ev)
    early = (z * 1).cpu()
    check.exact(early, settled(z), "copy_blocks", "a read behind wait_event(an event recorded a second time)")


def test_graph_captures_side_stream_fork_join(backend, check, gen):
    """Waits captured into a graph: inside a capture, work forks onto a side stream (an event recorded
    on the capturing stream, waited by the side stream) and joins back (an event recorded on the side
    stream, waited by the current one) — as the engine's prefetch does. Replays after the input
    changed in place give the joined result: the captured waits order the replay."""
    _graphs(backend.capabilities)
    dev = backend.device
    on = dev.torch_device
    x = torch.zeros(4099, device=on)
    side, fork, join = dev.new_stream(), dev.new_event(), dev.new_event()
    dev.synchronize()

    def step():
        y = x * 2
        fork.record(dev.current_stream())
        side.wait_event(fork)
        with dev.stream_context(side):
            z = (y + 1).mul_(3)
        join.record(side)
        dev.current_stream().wait_event(join)
        return z - x

    graph, out = dev.capture_graph(step, dev.graph_pool(), dev.new_stream())
    dev.synchronize()
    for trial in range(2):
        xs = randn(gen, 4099)
        x.copy_(xs.to(on))
        graph.replay()
        dev.synchronize()
        check.exact(out.cpu(), (xs * 2 + 1) * 3 - xs, "copy_blocks",
                    f"graph with a side-stream fork/join, replay {trial} after the input changed")
    del graph

"""Transfer: KV blocks round-trip between two endpoints of the backend (write, then async read back)."""

from __future__ import annotations

import time

import pytest
import torch

from conformance.harness import randn
from conformance.report import not_supported
from hwkv.interfaces import KVCacheSpec

pytestmark = [pytest.mark.capability("transfer"), pytest.mark.timeout_s(60)]
BLOCK_BYTES = 128 << 10  # about this many bytes per block and KV tensor
SEGMENT = 9 << 19  # a merged run of at least 4.5 MiB: one segment past a 4 MiB limit
SINGLES = 48  # scattered single blocks: about 100 segments per call with K and V of 2 layers


def _ids(gen: torch.Generator, run: int) -> tuple[list[int], list[int], list[int], int]:
    """(source ids, destination ids, read-back ids, num_blocks): one long run consecutive on both
    sides among shuffled singles, every side distinct."""
    n = 2 * run + 2 * SINGLES
    src_single = (2 * run + torch.randperm(n - 2 * run, generator=gen)[:SINGLES]).tolist()
    dst_single = torch.randperm(n, generator=gen).tolist()
    dst_single = [b for b in dst_single if not run <= b < 2 * run][:SINGLES]
    back = torch.randperm(n, generator=gen)[: SINGLES + run].tolist()
    at = SINGLES // 2
    src = src_single[:at] + list(range(run)) + src_single[at:]
    dst = dst_single[:at] + list(range(run, 2 * run)) + dst_single[at:]
    return src, dst, back, n


def test_transfer_round_trip(backend, check, gen, protocol):
    """Rounds between two endpoints, small (8 blocks, merged runs and singles) and production-size (a
    >= 4.5 MiB segment among ~100), each once with blocking ``write`` + asynchronous ``submit_read``
    / ``wait`` and once with ``submit_write`` / ``poll`` + blocking ``read``."""
    caps = backend.capabilities
    if protocol not in caps.transfer_protocols:
        not_supported(caps.validate(_spec(caps), transfer_protocol=protocol))
    a = backend.create_transfer(protocol=protocol)
    b = None
    regs: list[tuple[object, int]] = []
    try:
        b = backend.create_transfer(protocol=protocol)
        # tcp moves host memory (accelerators stage KV through pinned host buffers); device-native
        # protocols (rdma, ascend, ...) move device memory directly.
        host = protocol == "tcp"
        one = backend.device.allocate_kv_cache(_spec(caps), backend.attention.kv_layout, host=True)
        run = -(-SEGMENT // min(one.block_nbytes(i) for i in range(len(one.tensors))))
        src_ids, dst_ids, back_ids, nb = _ids(gen, run)
        for asynchronous in (False, True):
            _round_trip(backend, check, gen, a, b, regs, host, _spec(caps, 8, kv_heads=2), [5, 6, 7, 2, 0],
                        [0, 1, 2, 6, 4], [3, 4, 5, 0, 1], asynchronous)
            _round_trip(backend, check, gen, a, b, regs, host, _spec(caps, nb), src_ids, dst_ids, back_ids,
                        asynchronous, production=True)
    finally:
        try:
            for ep, ptr in regs:
                ep.unregister(ptr)
        finally:  # an unregister that fails must not leave the endpoints open
            a.close()
            if b is not None:
                b.close()


def _round_trip(backend, check, gen, a, b, regs, host: bool, spec: KVCacheSpec, src_ids: list[int],
                dst_ids: list[int], back_ids: list[int], asynchronous: bool, production: bool = False) -> None:
    """Blocks ``src_ids`` of ``a``'s cache to ``dst_ids`` at ``b``, then read back into ``back_ids``;
    ``asynchronous``: submit_write + poll, then read; else write, then submit_read + wait."""
    alloc = lambda: backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=host)
    src, dst, back = alloc(), alloc(), alloc()
    for t in src.tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))
    for ep, kv in ((a, src), (b, dst), (a, back)):
        for t in kv.tensors:
            ep.register(t.data_ptr(), t.numel() * t.element_size())
            regs.append((ep, t.data_ptr()))
    backend.device.synchronize()
    pa, pb, lens = src.paired_addresses(dst, src_ids, dst_ids)
    if production:
        assert max(lens) >= 4 << 20 and len(lens) >= 2 * SINGLES, "the case needs >= 4 MiB and many segments"
    if asynchronous:
        batch = a.submit_write(b.endpoint(), pa, pb, lens)
        deadline = time.monotonic() + 60
        while not a.poll(batch):
            assert time.monotonic() < deadline, "submit_write: poll() not done after 60 s"
            time.sleep(0.001)
    else:
        a.write(b.endpoint(), pa, pb, lens)
    for ti, (ts, td) in enumerate(zip(src.tensors, dst.tensors)):
        want = torch.zeros_like(ts).cpu()
        want[dst_ids] = ts[src_ids].cpu()
        check.exact(td.cpu(), want, "transfer", f"tensor {ti} at the peer after a write of {len(lens)} segments")
    # read back into other blocks (another segmentation)
    pl, pr, lens = back.paired_addresses(dst, back_ids, dst_ids)
    if asynchronous:
        a.read(b.endpoint(), pl, pr, lens)
    else:
        a.wait(a.submit_read(b.endpoint(), pl, pr, lens), **({"timeout_s": 60.0} if production else {}))
    for ti, (ts, tb) in enumerate(zip(src.tensors, back.tensors)):
        want = torch.zeros_like(ts).cpu()
        want[back_ids] = ts[src_ids].cpu()
        check.exact(tb.cpu(), want, "transfer", f"tensor {ti} after a read back of {len(lens)} segments")
    while regs:  # release this round's buffers before they are freed (a later cache may reuse the memory)
        ep, ptr = regs.pop()
        ep.unregister(ptr)


def _spec(caps, num_blocks: int = 1, kv_heads: int | None = None) -> KVCacheSpec:
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    bs, dtype = caps.default_block_size, caps.dtypes[0]
    if kv_heads is None:  # about BLOCK_BYTES per block and tensor
        kv_heads = max(1, BLOCK_BYTES // (2 * bs * head * torch.empty((), dtype=dtype).element_size()))
    return KVCacheSpec(2, num_blocks, bs, kv_heads, head, dtype)


# -- suite 3.0: lengths, offsets, batches in flight, large batches ------------------------------------
ODD_LENGTHS = [1, 3, 7, 4095, 4097, 65537, (1 << 20) + 1, (64 << 20) + 1]  # no page size divides them
REGION = (66 << 20) + (1 << 20)  # one registered region per side holds every segment
MANY = 3000  # segments in one batch: past 2,048-entry descriptor tables


def _endpoints(backend, protocol):
    caps = backend.capabilities
    if protocol not in caps.transfer_protocols:
        not_supported(caps.validate(_spec(caps), transfer_protocol=protocol))
    a = backend.create_transfer(protocol=protocol)
    try:
        b = backend.create_transfer(protocol=protocol)
    except BaseException:
        a.close()
        raise
    return a, b


def _region(backend, protocol, n: int) -> torch.Tensor:
    """``n`` bytes where the protocol moves them: host memory for tcp, device memory otherwise."""
    if protocol == "tcp":
        return backend.device.host_empty(n, torch.uint8)
    return torch.empty(n, dtype=torch.uint8, device=backend.device.torch_device)


def _layout(lengths: list[int], start: int, gen: torch.Generator) -> list[int]:
    """Offsets of ``lengths`` packed from ``start`` in shuffled order with odd gaps (never aligned)."""
    order = torch.randperm(len(lengths), generator=gen).tolist()
    offs, at = [0] * len(lengths), start
    for i in order:
        offs[i] = at
        at += lengths[i] + 1 + (i % 5)
    return offs


def test_transfer_lengths_offsets_and_batches(backend, check, gen, protocol):
    """Segments of 1 B .. 64 MiB + 1 (no page size divides them) at odd, non-zero offsets inside one
    registered region per side; a batch of 3,000 small segments; three batches in flight at once
    (two writes and a read, to disjoint ranges) polled and waited out of submission order. Every byte
    lands where its segment says, and no byte outside the segments changes."""
    a, b = _endpoints(backend, protocol)
    src, dst = _region(backend, protocol, REGION), _region(backend, protocol, REGION)
    regs = []
    try:
        pattern = torch.randint(0, 256, (65521,), generator=gen, dtype=torch.uint8)  # prime period: offsets show
        src.copy_(pattern.repeat(-(-REGION // pattern.numel()))[:REGION].to(src.device))
        dst.fill_(0)
        backend.device.synchronize()
        for ep, t in ((a, src), (b, dst)):
            ep.register(t.data_ptr(), REGION)
            regs.append((ep, t.data_ptr()))
        sp, dp = src.data_ptr(), dst.data_ptr()
        want = torch.zeros(REGION, dtype=torch.uint8)
        src_h = src.cpu()

        def expect(s_off, d_off, lengths):
            for so, do, n in zip(s_off, d_off, lengths):
                want[do : do + n] = src_h[so : so + n]

        def verify(what):
            check.exact(dst.cpu(), want, "transfer", what)

        # 1. odd lengths at odd offsets, one blocking write
        s_off, d_off = _layout(ODD_LENGTHS, 13, gen), _layout(ODD_LENGTHS, 1, gen)
        a.write(b.endpoint(), [sp + o for o in s_off], [dp + o for o in d_off], ODD_LENGTHS)
        expect(s_off, d_off, ODD_LENGTHS)
        verify(f"peer region after a write of segments of {ODD_LENGTHS} bytes at odd offsets")
        # 2. many small segments in one asynchronous batch
        lens = (torch.randint(1, 300, (MANY,), generator=gen)).tolist()
        s_off, d_off = _layout(lens, 5, gen), _layout(lens, 3, gen)
        a.wait(a.submit_write(b.endpoint(), [sp + o for o in s_off], [dp + o for o in d_off], lens), timeout_s=60.0)
        want.zero_()
        dst.fill_(0)  # nothing else is in flight; reset both sides' view
        backend.device.synchronize()
        a.write(b.endpoint(), [sp + o for o in s_off], [dp + o for o in d_off], lens)
        expect(s_off, d_off, lens)
        verify(f"peer region after a batch of {MANY} segments")
        # 3. three batches in flight, completed out of order
        third = REGION // 3
        # the read below fetches the peer's last third: fill it first (step 2 left it zero, and a read
        # that never ran would look like one that read zeros)
        a.write(b.endpoint(), [sp + 2 * third], [dp + 2 * third], [REGION - 2 * third])
        expect([2 * third], [2 * third], [REGION - 2 * third])
        l1 = [(8 << 20) + 5, 4097, 1]
        l2 = [33, (2 << 20) + 3]
        o1s, o1d = _layout(l1, 7, gen), _layout(l1, 9, gen)
        o2s, o2d = _layout(l2, third + 11, gen), _layout(l2, third + 17, gen)
        back = _region(backend, protocol, third)
        back.fill_(0)
        backend.device.synchronize()
        a.register(back.data_ptr(), third)
        regs.append((a, back.data_ptr()))
        b1 = a.submit_write(b.endpoint(), [sp + o for o in o1s], [dp + o for o in o1d], l1)
        b2 = a.submit_write(b.endpoint(), [sp + o for o in o2s], [dp + o for o in o2d], l2)
        # the read fetches peer bytes no write touches (the last third, filled just above)
        l3 = [4095, (1 << 20) + 7]
        o3r, o3l = _layout(l3, 2 * third + 1, gen), _layout(l3, 3, gen)
        b3 = a.submit_read(b.endpoint(), [back.data_ptr() + o for o in o3l], [dp + o for o in o3r], l3)
        assert len({b1, b2, b3}) == 3, f"three batches in flight got ids {b1, b2, b3}: each needs its own"
        deadline = time.monotonic() + 60
        while not a.poll(b3):
            assert time.monotonic() < deadline, "submit_read: poll() not done after 60 s"
            time.sleep(0.001)
        a.wait(b2, timeout_s=60.0)
        a.wait(b1, timeout_s=60.0)
        peer_before = want.clone()
        got_back = back.cpu()
        want_back = torch.zeros(third, dtype=torch.uint8)
        for lo, ro, n in zip(o3l, o3r, l3):
            want_back[lo : lo + n] = peer_before[ro : ro + n]
        check.exact(got_back, want_back, "transfer", "local region after a read in flight beside two writes")
        expect(o1s, o1d, l1)
        expect(o2s, o2d, l2)
        verify("peer region after two writes in flight, waited out of order")
    finally:
        try:
            for ep, ptr in regs:
                ep.unregister(ptr)
        finally:
            a.close()
            b.close()


def test_transfer_failure_is_reported(backend, check, gen, protocol):
    """(3.2) A transfer that cannot complete is never a silent success: a write whose remote range runs
    past the end of the peer's registered region raises :class:`TransferError` from the blocking
    ``write``, and from ``submit_write`` or a later ``poll`` (``poll`` never returns True for it); the
    endpoints work afterwards. The vendor bug: a failed batch that polls as done (the error only logged)."""
    from hwkv.interfaces.transfer import TransferError

    caps = backend.capabilities
    if protocol not in caps.transfer_protocols:
        not_supported(caps.validate(_spec(caps), transfer_protocol=protocol))
    host = protocol == "tcp"
    alloc = lambda: backend.device.allocate_kv_cache(_spec(caps, 4), backend.attention.kv_layout, host=host)  # noqa: E731
    a = backend.create_transfer(protocol=protocol)
    b = None
    regs: list[tuple[object, int]] = []
    try:
        b = backend.create_transfer(protocol=protocol)
        src, dst = alloc(), alloc()
        for t in src.tensors:
            t.copy_(randn(gen, *t.shape, dtype=t.dtype))
        for ep, t in ((a, src.tensors[0]), (b, dst.tensors[0])):
            ep.register(t.data_ptr(), t.numel() * t.element_size())
            regs.append((ep, t.data_ptr()))
        backend.device.synchronize()
        s, d = src.tensors[0], dst.tensors[0]
        n = s.numel() * s.element_size()
        past = [d.data_ptr() + n - 4096]  # 4 KiB inside, 4 KiB past the end of the peer's region
        with pytest.raises(TransferError):
            a.write(b.endpoint(), [s.data_ptr()], past, [8192])
        with pytest.raises(TransferError):
            batch = a.submit_write(b.endpoint(), [s.data_ptr()], past, [8192])
            deadline = time.monotonic() + 60
            while not a.poll(batch):
                assert time.monotonic() < deadline, "poll() of a failing batch neither raised nor completed in 60 s"
                time.sleep(0.001)
        a.write(b.endpoint(), [s.data_ptr()], [d.data_ptr()], [n])  # the endpoints still work
        check.exact(d.cpu(), s.cpu(), "transfer", "a whole-region write after two failed ones")
    finally:
        try:
            for ep, ptr in regs:
                ep.unregister(ptr)
        finally:
            a.close()
            if b is not None:
                b.close()

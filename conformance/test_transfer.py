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

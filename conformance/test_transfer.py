"""Transfer: KV blocks round-trip between two endpoints of the backend (write, then async read back)."""

from __future__ import annotations

import pytest
import torch

from conformance.harness import randn
from conformance.report import not_supported
from hwkv.interfaces import KVCacheSpec

pytestmark = [pytest.mark.capability("transfer"), pytest.mark.timeout_s(60)]
NUM_BLOCKS = 8
SRC_IDS, DST_IDS = [5, 6, 7, 2, 0], [0, 1, 2, 6, 4]  # two merged runs and scattered singles


def test_transfer_round_trip(backend, check, gen, protocol):
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
        spec = _spec(caps)
        alloc = lambda: backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=host)
        src, dst, back = alloc(), alloc(), alloc()
        for t in src.tensors:
            t.copy_(randn(gen, *t.shape, dtype=t.dtype))
        for ep, kv in ((a, src), (b, dst), (a, back)):
            for t in kv.tensors:
                ep.register(t.data_ptr(), t.numel() * t.element_size())
                regs.append((ep, t.data_ptr()))
        backend.device.synchronize()
        pa, pb, lens = src.paired_addresses(dst, SRC_IDS, DST_IDS)
        a.write(b.endpoint(), pa, pb, lens)
        for ti, (ts, td) in enumerate(zip(src.tensors, dst.tensors)):
            want = torch.zeros_like(ts).cpu()
            want[DST_IDS] = ts[SRC_IDS].cpu()
            check.exact(td.cpu(), want, "transfer", f"tensor {ti} at the peer after write")
        # read back into other blocks, asynchronously
        back_ids = [3, 4, 5, 0, 1]
        pl, pr, lens = back.paired_addresses(dst, back_ids, DST_IDS)
        batch = a.submit_read(b.endpoint(), pl, pr, lens)
        a.wait(batch)
        for ti, (ts, tb) in enumerate(zip(src.tensors, back.tensors)):
            want = torch.zeros_like(ts).cpu()
            want[back_ids] = ts[SRC_IDS].cpu()
            check.exact(tb.cpu(), want, "transfer", f"tensor {ti} after read back")
    finally:
        try:
            for ep, ptr in regs:
                ep.unregister(ptr)
        finally:  # an unregister that fails must not leave the endpoints open
            a.close()
            if b is not None:
                b.close()


def _spec(caps) -> KVCacheSpec:
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    return KVCacheSpec(2, NUM_BLOCKS, caps.default_block_size, 2, head, caps.dtypes[0])

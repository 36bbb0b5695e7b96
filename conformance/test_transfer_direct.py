"""Transfer, same-host direct protocols (``cuda_ipc``, ``cma``; hwkv.transfer.direct): beyond the round
trip every protocol passes (test_transfer.py), the path is probed before use, a buffer the peer
unregistered is refused (never written), and a closed endpoint refuses — within the endpoint's
timeout, with :class:`TransferError`."""

from __future__ import annotations

import time

import pytest
import torch

from conformance.harness import randn
from conformance.report import not_supported
from hwkv.interfaces import KVCacheSpec
from hwkv.interfaces.transfer import TransferError
from hwkv.transfer.direct import DIRECT_PROTOCOLS

pytestmark = [pytest.mark.capability("transfer"), pytest.mark.timeout_s(60)]


def test_direct_transfer_probe_revocation_and_close(backend, check, gen):
    caps = backend.capabilities
    direct = [p for p in caps.transfer_protocols if p in DIRECT_PROTOCOLS]
    if not direct:
        not_supported(f"no same-host direct protocol declared (declared: {list(caps.transfer_protocols)}; direct "
                      f"ones: {', '.join(DIRECT_PROTOCOLS)})")
    for protocol in direct:
        _probe_revoke_close(backend, check, gen, protocol)


def _probe_revoke_close(backend, check, gen, protocol: str) -> None:
    caps = backend.capabilities
    spec = KVCacheSpec(1, 4, caps.default_block_size, 2, 64 if caps.head_sizes is None else caps.head_sizes[0],
                       caps.dtypes[0])
    a = backend.create_transfer(protocol=protocol, timeout_s=2.0)
    b = backend.create_transfer(protocol=protocol, timeout_s=2.0)
    try:
        src = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout)
        dst = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout)
        for t in src.tensors:
            t.copy_(randn(gen, *t.shape, dtype=t.dtype))
        for t in dst.tensors:
            t.zero_()
        backend.device.synchronize()
        s, d = src.tensors[0], dst.tensors[0]
        n = s.numel() * s.element_size()
        a.register(s.data_ptr(), n)
        b.register(d.data_ptr(), n)
        a.probe(b.endpoint())  # the path works: b's probe word read through the protocol
        a.write(b.endpoint(), [s.data_ptr()], [d.data_ptr()], [n])
        check.exact(d.cpu(), s.cpu(), "transfer", f"{protocol}: one write of the whole tensor")
        b.unregister(d.data_ptr())  # revoked: a must re-learn b's buffers and refuse the range
        d.zero_()
        backend.device.synchronize()
        with pytest.raises(TransferError):
            a.write(b.endpoint(), [s.data_ptr()], [d.data_ptr()], [n])
        check.exact(d.cpu(), torch.zeros_like(d).cpu(), "transfer", f"{protocol}: nothing written after unregister")
        b.close()
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            a.write(b.endpoint(), [s.data_ptr()], [d.data_ptr()], [n])
        assert time.monotonic() - t0 < 10, "a write to a closed peer must fail within the endpoint's timeout"
        a.close()
        with pytest.raises(TransferError, match="closed"):
            a.write(b.endpoint(), [s.data_ptr()], [d.data_ptr()], [n])
    finally:
        a.close()
        b.close()


def test_direct_write_after_an_event_moves_what_was_written_before_it(backend, check, gen):
    """``submit_write(..., after=event)`` (a layerwise push: the event recorded by the forward after it
    wrote a layer's KV): the copy moves the bytes written on the device before the event — ordered on
    the device where the mover can (``orders_after``: ``cuda_ipc``), waited on the host otherwise."""
    caps = backend.capabilities
    direct = [p for p in caps.transfer_protocols if p in DIRECT_PROTOCOLS]
    if not direct:
        not_supported(f"no same-host direct protocol declared (declared: {list(caps.transfer_protocols)})")
    spec = KVCacheSpec(1, 4, caps.default_block_size, 2, 64 if caps.head_sizes is None else caps.head_sizes[0],
                       caps.dtypes[0])
    for protocol in direct:
        a = backend.create_transfer(protocol=protocol, timeout_s=2.0)
        b = backend.create_transfer(protocol=protocol, timeout_s=2.0)
        try:
            src = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout).tensors[0]
            dst = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout).tensors[0]
            src.zero_()
            dst.zero_()
            backend.device.synchronize()
            n = src.numel() * src.element_size()
            a.register(src.data_ptr(), n)
            b.register(dst.data_ptr(), n)
            src.copy_(randn(gen, *src.shape, dtype=src.dtype).to(src.device))  # the "forward", not synchronized
            ev = backend.device.new_event()
            ev.record()
            a.wait(a.submit_write(b.endpoint(), [src.data_ptr()], [dst.data_ptr()], [n], after=ev), timeout_s=30.0)
            check.exact(dst.cpu(), src.cpu(), "transfer", f"{protocol}: submit_write(after=event) moved the bytes "
                        "written before the event")
        finally:
            a.close()
            b.close()

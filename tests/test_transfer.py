"""MooncakeTransfer against the real Mooncake TransferEngine: two endpoints in this process over tcp
on loopback (P2P handshake, and through a real mooncake_master's HTTP metadata server)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hwkv.interfaces import KVCache, KVCacheSpec, KVLayoutKind, TransferError
from hwkv.stores.mooncake_service import mooncake_master
from hwkv.testing.mooncake import skip_unless_mooncake
from hwkv.transfer.mooncake import MooncakeTransfer, free_port

pytestmark = pytest.mark.mooncake
skip_unless_mooncake(allow_module_level=True)

MiB = 1 << 20


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.fixture(scope="module")
def pair():
    a, b = MooncakeTransfer(protocol="tcp"), MooncakeTransfer(protocol="tcp")
    yield a, b
    a.close()
    b.close()
    assert a.registered_buffers() == [] and b.registered_buffers() == []


@pytest.fixture
def buffers(pair):
    """A random 1 MiB source on ``a``, a zeroed 1 MiB destination on ``b``, and a zeroed 1 MiB
    scratch on ``a``, all registered; unregistered (and checked) after the test."""
    a, b = pair
    rng = np.random.default_rng(0)
    src, dst, back = rng.integers(0, 256, MiB, dtype=np.uint8), np.zeros(MiB, np.uint8), np.zeros(MiB, np.uint8)
    a.register(ptr(src), MiB)
    a.register(ptr(back), MiB)
    b.register(ptr(dst), MiB)
    yield src, dst, back
    a.unregister(ptr(src))
    a.unregister(ptr(back))
    b.unregister(ptr(dst))
    assert a.registered_buffers() == [] and b.registered_buffers() == []


# (src offset, dst offset, length): disjoint, odd offsets and lengths, up to the last source byte
SEGMENTS = [(3, 100_001, 1), (4095, 5, 8193), (70_000, 600_000, 65_537), (MiB - 77, 900_000, 77),
            (200_000, 300_000, 4096)]


def test_write_then_read_moves_exact_bytes(pair, buffers):
    a, b = pair
    src, dst, back = buffers
    a.write(b.endpoint(), [ptr(src) + s for s, _, _ in SEGMENTS], [ptr(dst) + d for _, d, _ in SEGMENTS],
            [n for _, _, n in SEGMENTS])
    expected = np.zeros(MiB, np.uint8)
    for s, d, n in SEGMENTS:
        expected[d:d + n] = src[s:s + n]
    assert np.array_equal(dst, expected)  # the segments arrived, nothing else was touched
    # read the same ranges back into the scratch buffer at the source offsets
    a.read(b.endpoint(), [ptr(back) + s for s, _, _ in SEGMENTS], [ptr(dst) + d for _, d, _ in SEGMENTS],
           [n for _, _, n in SEGMENTS])
    for s, _, n in SEGMENTS:
        assert np.array_equal(back[s:s + n], src[s:s + n])
    assert int(back.astype(np.int64).sum()) == sum(int(src[s:s + n].astype(np.int64).sum()) for s, _, n in SEGMENTS)


def test_more_segments_than_one_mooncake_batch_takes(pair, buffers):
    """The wheel fails a sync batch of more than 2048 segments (code -1): a long prompt's KV in
    scattered blocks is that many, so the transfer splits it."""
    a, b = pair
    src, dst, back = buffers
    n, seg = 4100, 200  # 820 KB in 4100 segments, every other 200-byte slot
    offs = [2 * i * seg % (MiB - seg) for i in range(n)]
    offs = sorted(set(offs))[:n]
    assert len(offs) > 2 * 2048
    dst[:] = 0
    a.write(b.endpoint(), [ptr(src) + o for o in offs], [ptr(dst) + o for o in offs], [seg] * len(offs))
    back[:] = 0
    a.read(b.endpoint(), [ptr(back) + o for o in offs], [ptr(dst) + o for o in offs], [seg] * len(offs))
    for o in offs[:: 97] + offs[-3:]:
        assert np.array_equal(dst[o:o + seg], src[o:o + seg]) and np.array_equal(back[o:o + seg], src[o:o + seg])


def test_async_submit_and_poll(pair, buffers):
    a, b = pair
    src, dst, back = buffers
    n = 64
    offs = [i * 16_384 + i for i in range(n)]
    lens = [4096 + 17 * i for i in range(n)]
    batch = a.submit_write(b.endpoint(), [ptr(src) + o for o in offs], [ptr(dst) + o for o in offs], lens)
    polls = 0
    while not a.poll(batch):
        polls += 1
        assert polls < 1_000_000
    for o, ln in zip(offs, lens):
        assert np.array_equal(dst[o:o + ln], src[o:o + ln])
    with pytest.raises(ValueError, match="not a pending transfer batch"):
        a.poll(batch)  # completed batches are forgotten
    batch = a.submit_read(b.endpoint(), [ptr(back) + o for o in offs], [ptr(dst) + o for o in offs], lens)
    a.wait(batch, timeout_s=10)
    for o, ln in zip(offs, lens):
        assert np.array_equal(back[o:o + ln], src[o:o + ln])


def test_unregistered_local_memory_is_refused(pair, buffers):
    a, b = pair
    _, dst, _ = buffers
    stray = np.ones(4096, np.uint8)
    with pytest.raises(TransferError, match="not inside a registered buffer"):
        a.write(b.endpoint(), [ptr(stray)], [ptr(dst)], [4096])
    with pytest.raises(TransferError, match="not inside a registered buffer"):
        a.submit_read(b.endpoint(), [ptr(stray)], [ptr(dst)], [4096])
    assert not dst.any()


def test_unregistered_remote_memory_fails(pair, buffers):
    a, b = pair
    src, _, _ = buffers
    remote_stray = np.zeros(4096, np.uint8)  # memory of b's process, but never registered with b
    with pytest.raises(TransferError, match="failed with code"):
        a.write(b.endpoint(), [ptr(src)], [ptr(remote_stray)], [4096])
    batch = a.submit_write(b.endpoint(), [ptr(src), ptr(src)], [ptr(remote_stray), ptr(remote_stray)], [100, 100])
    with pytest.raises(TransferError, match="2 segment"):
        a.wait(batch)
    assert not remote_stray.any()


def test_bad_peer(pair, buffers):
    a, _ = pair
    src, dst, _ = buffers
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(TransferError, match=nobody):
        a.write(nobody, [ptr(src)], [ptr(dst)], [64])
    with pytest.raises(TransferError, match="could not be submitted"):
        a.submit_write(nobody, [ptr(src)], [ptr(dst)], [64])


def test_bad_input_raises_value_error(pair, buffers):
    a, b = pair
    src, dst, _ = buffers
    with pytest.raises(ValueError, match="differ in length"):
        a.write(b.endpoint(), [ptr(src)], [ptr(dst), ptr(dst)], [1])
    with pytest.raises(ValueError, match="length 0"):
        a.write(b.endpoint(), [ptr(src)], [ptr(dst)], [0])
    with pytest.raises(ValueError, match="no segments"):
        a.write(b.endpoint(), [], [], [])
    with pytest.raises(ValueError, match="overlaps"):
        a.register(ptr(src) + 10, 10)
    with pytest.raises(ValueError, match="not a registered buffer"):
        a.unregister(ptr(src) + 1)
    with pytest.raises(ValueError, match="protocol='udp'"):
        MooncakeTransfer(protocol="udp")


@pytest.mark.parametrize("bad,why", [(True, "pointer True is a bool"), (1 << 70, "outside the address space"),
                                     (0, "outside the address space"), ((1 << 56) - 8, "outside the address space"),
                                     (4096.0, "is a float")])
def test_bad_pointers_are_refused_before_memory_is_touched(pair, buffers, bad, why):
    """Bools and integers outside (0, 2**56] are refused naming the argument, the item index and the
    allowed range, before the endpoint touches memory (the engine would read or write there)."""
    a, b = pair
    src, dst, back = buffers
    ok_src, ok_dst = [ptr(src), ptr(src) + 64], [ptr(dst), ptr(dst) + 64]
    allowed = r"allowed: 0 < ptr, 0 < nbytes, ptr \+ nbytes <= 2\*\*56"
    with pytest.raises(ValueError, match=rf"^write: src_ptrs\[1\]: .*{why}.*{allowed}"):
        a.write(b.endpoint(), [ok_src[0], bad], ok_dst, [16, 16])
    with pytest.raises(ValueError, match=rf"^submit_write: dst_ptrs\[1\]: .*{why}"):
        a.submit_write(b.endpoint(), ok_src, [ok_dst[0], bad], [16, 16])
    with pytest.raises(ValueError, match=rf"^read: remote_ptrs\[0\]: .*{why}"):
        a.read(b.endpoint(), [ptr(back)], [bad], [16])
    with pytest.raises(ValueError, match=rf"^submit_read: local_ptrs\[0\]: .*{why}"):
        a.submit_read(b.endpoint(), [bad], [ptr(dst)], [16])
    with pytest.raises(ValueError, match=rf"^register_memory: .*{why}"):
        a.register(bad, 4096)
    in_range = isinstance(bad, int) and not isinstance(bad, bool) and 0 < bad < 1 << 56
    with pytest.raises(ValueError, match="not a registered buffer" if in_range else rf"^unregister_memory: .*{why}"):
        a.unregister(bad)
    assert not dst.any() and not back.any()
    assert a.registered_buffers() == sorted([(ptr(src), MiB), (ptr(back), MiB)])


def test_bad_lengths_lists_and_peer_are_refused(pair, buffers):
    a, b = pair
    src, dst, _ = buffers
    with pytest.raises(ValueError, match=r"length True at lengths\[0\] is invalid"):
        a.write(b.endpoint(), [ptr(src)], [ptr(dst)], [True])
    with pytest.raises(ValueError, match=rf"src_ptrs\[0\]: range .*nbytes={1 << 57}\) is outside"):
        a.write(b.endpoint(), [ptr(src)], [ptr(dst)], [1 << 57])
    with pytest.raises(ValueError, match="src_ptrs must be a list of ints, got a int"):
        a.write(b.endpoint(), ptr(src), [ptr(dst)], [16])
    with pytest.raises(ValueError, match=r"differ in length \(src_ptrs: 1, lengths: 1, dst_ptrs: 2\)"):
        a.write(b.endpoint(), [ptr(src)], [ptr(dst), ptr(dst)], [16])
    with pytest.raises(ValueError, match="peer=None is invalid"):
        a.write(None, [ptr(src)], [ptr(dst)], [16])
    with pytest.raises(ValueError, match="not a pending transfer batch"):
        a.poll(True)
    assert not dst.any()


def test_kv_cache_blocks_round_trip(pair):
    """The real use: move some blocks of one KV cache into another through ``KVCache.addresses``."""
    a, b = pair
    spec = KVCacheSpec(num_layers=3, num_blocks=10, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    g = torch.Generator().manual_seed(0)
    src = KVCache.allocate(spec, KVLayoutKind.SEPARATE_KV)
    dst = KVCache.allocate(spec, KVLayoutKind.SEPARATE_KV)
    for t in src.tensors:
        t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).half())
    for t in src.tensors:
        a.register(t.data_ptr(), t.numel() * t.element_size())
    for t in dst.tensors:
        b.register(t.data_ptr(), t.numel() * t.element_size())
    try:
        ids = [1, 2, 3, 7]
        s, d = src.addresses(ids), dst.addresses(ids)
        a.write(b.endpoint(), [p for p, _ in s], [p for p, _ in d], [n for _, n in s])
        for i in range(spec.num_blocks):
            same = all(torch.equal(x, y) for x, y in zip(src.block_bytes(i), dst.block_bytes(i)))
            assert same == (i in ids), i
    finally:
        for t in src.tensors:
            a.unregister(t.data_ptr())
        for t in dst.tensors:
            b.unregister(t.data_ptr())


def test_http_metadata_server_and_close_releases_everything():
    """Endpoints named through a real master's HTTP metadata server; close drains and unregisters."""
    with mooncake_master() as m:
        a = MooncakeTransfer(metadata_server=m.metadata_server)
        b = MooncakeTransfer(metadata_server=m.metadata_server)
        assert a.endpoint() != b.endpoint()
        src = np.random.default_rng(1).integers(0, 256, 64 * 1024, dtype=np.uint8)
        dst = np.zeros_like(src)
        a.register(ptr(src), src.nbytes)
        b.register(ptr(dst), dst.nbytes)
        batch = a.submit_write(b.endpoint(), [ptr(src)], [ptr(dst)], [src.nbytes])
        a.close()  # waits for the in-flight batch before unregistering
        b.close()
        b.close()  # idempotent
        assert np.array_equal(src, dst)
        assert a.registered_buffers() == [] and b.registered_buffers() == []
        with pytest.raises(TransferError, match="closed"):
            a.poll(batch)
        with pytest.raises(TransferError, match="closed"):
            a.register(ptr(src), 16)


@pytest.fixture
def silent_peer():
    """An endpoint address that accepts connections and never answers (a hung peer): the wheel's
    handshake waits ~60 s for it."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()


def test_hung_peer_times_out_without_freezing_other_threads(silent_peer):
    """write/read/submit to a peer that never answers end with TransferTimeout within timeout_s
    while another thread keeps running; close returns within its bound (leaving the engine to the
    process, since the wheel's calls are still waiting on the peer)."""
    import threading
    import time

    from hwkv.interfaces import TransferTimeout

    t = MooncakeTransfer(timeout_s=0.5)
    buf = np.zeros(4096, np.uint8)
    t.register(ptr(buf), buf.nbytes)
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0.001)

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        calls = {"write": lambda: t.write(silent_peer, [ptr(buf)], [4096], [64]),
                 "read": lambda: t.read(silent_peer, [ptr(buf)], [4096], [64]),
                 "submit_write": lambda: t.submit_write(silent_peer, [ptr(buf)], [4096], [64])}
        for op, call in calls.items():
            c0, t0 = count[0], time.monotonic()
            with pytest.raises(TransferTimeout, match=rf"^{op} with '{silent_peer}' \(1 segments, 64 B\) did not "
                                                      r"finish within 0.5 s"):
                call()
            took = time.monotonic() - t0
            assert took < 1.5 and count[0] - c0 > 20, (op, took, count[0] - c0)
        with pytest.raises(TransferTimeout, match="timed-out transfers still running"):
            t.unregister(ptr(buf))
        assert t.registered_buffers() == [(ptr(buf), buf.nbytes)]
        t0 = time.monotonic()
        t.close()
        assert time.monotonic() - t0 < 1.5
        assert t.registered_buffers() == []
        with pytest.raises(TransferError, match="closed"):
            t.write(silent_peer, [ptr(buf)], [4096], [64])
    finally:
        stop.set()
        spinner.join(5)
        t.close()

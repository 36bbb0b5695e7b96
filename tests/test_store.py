"""Store semantics: one suite run against the EmbeddedStore and a real Mooncake store behind a real
mooncake_master, plus what each does on its own (strict LRU vs. Mooncake's background eviction)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hwkv.interfaces import KeyNotFound, SizeMismatch, StoreError, StoreFull, StoreUnavailable
from hwkv.stores import create_store
from hwkv.stores.embedded import EmbeddedStore
from hwkv.stores.mooncake_service import master_metrics, mooncake_master
from hwkv.testing.mooncake import skip_unless_mooncake
from hwkv.transfer.mooncake import free_port

MiB = 1 << 20
CAP = 16 * MiB  # both stores: Mooncake's smallest global segment


class Arena:
    """Random source bytes and a zeroed destination; every put reads ``src``, every get fills ``dst``."""

    def __init__(self, nbytes: int = 24 * MiB):
        self.src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)

    def s(self, off: int, n: int) -> tuple[int, int]:
        return self.src.ctypes.data + off, n

    def d(self, off: int, n: int) -> tuple[int, int]:
        return self.dst.ctypes.data + off, n

    def value(self, segs: list[tuple[int, int]]) -> np.ndarray:
        """The bytes a put of ``segs`` (offsets into ``src``) stores."""
        return np.concatenate([self.src[o:o + n] for o, n in segs])

    def got(self, segs: list[tuple[int, int]]) -> np.ndarray:
        return np.concatenate([self.dst[o:o + n] for o, n in segs])


@pytest.fixture(scope="module")
def arena():
    return Arena()


@pytest.fixture(scope="module")
def mooncake(arena):
    skip_unless_mooncake()
    # a 2 s lease (default 10 s) keeps the lease test deterministic and eviction tests quick
    with mooncake_master(default_kv_lease_ttl_ms=2000) as m:
        store = create_store("mooncake", master=m.master, metadata_server=m.metadata_server, protocol="tcp",
                             global_segment_size=CAP)
        for buf in (arena.src, arena.dst):
            store.register_buffer(buf.ctypes.data, buf.nbytes)
        yield m, store
        for buf in (arena.src, arena.dst):
            store.unregister_buffer(buf.ctypes.data)
        assert store.registered_buffers() == []
        store.close()


@pytest.fixture(params=["embedded", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store(request, arena):
    arena.dst[:] = 0
    if request.param == "embedded":
        s = create_store("embedded", capacity_bytes=CAP)
        yield s
        s.close()
    else:
        m, s = request.getfixturevalue("mooncake")
        settle(m, s, arena)
        yield s
        s.clear()


@pytest.fixture
def mstore(mooncake, arena):
    """The module's Mooncake store, emptied (and settled) before and after the test."""
    arena.dst[:] = 0
    settle(*mooncake, arena)
    yield mooncake[1]
    mooncake[1].clear()


def settle(m, s, arena, rounds: int = 5, timeout_s: float = 5.0) -> None:
    """Empty the pool and leave the master with no eviction pending.

    A put that found no room sets the master's need-eviction flag, and the flag stays set while
    nothing is evictable (values leased or being written); ``clear`` does not reset it, the
    eviction thread's next pass does (every ~10 ms, later on a busy machine). Until then the next
    test's first value can be evicted (``test_mooncake_pending_eviction_takes_a_later_value``).
    So: put one evictable sentinel, set the flag with a put larger than the pool, and wait for the
    pass that evicts the sentinel, which also resets the flag. A round in which a pending pass took
    the sentinel before our flag was set proves nothing and is repeated."""
    for _ in range(rounds):
        s.clear()
        assert s.put(["__settle__"], [[arena.s(0, 1)]])[0].ok
        assert isinstance(s.put(["__too_big__"], [[arena.s(0, CAP), arena.s(CAP, 1)]])[0].error, StoreFull)
        before = master_metrics(m)
        if before["master_key_count"] != 1:
            continue

        def sentinel_evicted(before=before) -> bool:
            now = master_metrics(m)
            return (now["master_key_count"] == 0
                    and now["master_successful_evictions_total"] > before["master_successful_evictions_total"])

        if wait_until(sentinel_evicted, timeout_s):
            return
    raise AssertionError(f"mooncake_master did not settle its pending eviction in {rounds} rounds")


def wait_until(cond, timeout_s: float) -> bool:
    """Poll ``cond`` every 5 ms; whether it held within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def errors(results) -> list[type | None]:
    return [type(r.error) if r.error else None for r in results]


# ---- the shared contract ----------------------------------------------------------------------


def test_put_get_exact_bytes_and_missing_key(store, arena):
    a, b = [(7, 1000)], [(3, 10), (5000, 4096), (70_001, 123)]
    res = store.put(["a", "b"], [[arena.s(*x) for x in a], [arena.s(*x) for x in b]])
    assert errors(res) == [None, None] and [r.nbytes for r in res] == [1000, 4229]
    ga, gb = [(0, 1000)], [(2000, 4229)]
    res = store.get(["a", "missing", "b"], [[arena.d(*ga[0])], [arena.d(9000, 8)], [arena.d(*gb[0])]])
    assert errors(res) == [None, KeyNotFound, None]
    assert np.array_equal(arena.got(ga), arena.value(a)) and np.array_equal(arena.got(gb), arena.value(b))
    assert not arena.dst[9000:9008].any()  # a failed get writes nothing


def test_overwrite_replaces_value(store, arena):
    assert store.put(["k"], [[arena.s(0, 100)]])[0].ok
    assert store.put(["k"], [[arena.s(1000, 100)]])[0].ok  # same size, new bytes
    assert store.get(["k"], [[arena.d(0, 100)]])[0].ok
    assert np.array_equal(arena.dst[:100], arena.src[1000:1100])
    multi = [(5, 100), (777, 200)]
    assert store.put(["k"], [[arena.s(*x) for x in multi]])[0].ok  # different size, two segments
    res = store.get(["k", "k"], [[arena.d(0, 300)], [arena.d(1000, 100)]])
    assert errors(res) == [None, SizeMismatch]
    assert np.array_equal(arena.dst[:300], arena.value(multi))
    assert store.put(["k"], [[arena.s(4321, 50)]])[0].ok  # and back to one segment
    assert store.get(["k"], [[arena.d(0, 50)]])[0].ok
    assert np.array_equal(arena.dst[:50], arena.src[4321:4371])


def test_exists_and_remove(store, arena):
    store.put(["a"], [[arena.s(0, 64)]])
    assert store.exists(["a", "b"]) == [True, False]
    assert errors(store.remove(["a", "b"])) == [None, KeyNotFound]
    assert store.exists(["a", "b"]) == [False, False]
    assert errors(store.get(["a"], [[arena.d(0, 64)]])) == [KeyNotFound]


def test_size_mismatch_reports_stored_size_and_keeps_value(store, arena):
    store.put(["v"], [[arena.s(11, 4096)]])
    wrong = [[arena.d(0, 4095)], [arena.d(0, 4097)], [arena.d(0, 2000), arena.d(5000, 2000)],
             [arena.d(0, 2000), arena.d(5000, 3000)]]
    for segs in wrong:
        (r,) = store.get(["v"], [segs])
        assert isinstance(r.error, SizeMismatch) and r.nbytes == 4096, segs
    (r,) = store.get(["v"], [[arena.d(100, 1000), arena.d(9000, 3096)]])
    assert r.ok and np.array_equal(arena.got([(100, 1000), (9000, 3096)]), arena.src[11:4107])


def test_multi_segment_values(store, arena):
    put_segs = [(0, 1), (10, 4095), (100_000, 65_537), (2 * MiB + 3, 300_000), (5 * MiB, 13)]
    total = sum(n for _, n in put_segs)
    get_segs = [(1, 12_345), (500_000, total - 12_345 - 7), (3 * MiB, 7)]
    assert store.put(["m"], [[arena.s(*x) for x in put_segs]])[0].nbytes == total
    assert store.get(["m"], [[arena.d(*x) for x in get_segs]])[0].ok
    assert np.array_equal(arena.got(get_segs), arena.value(put_segs))


def test_batch_partial_failure(store, arena):
    res = store.put(["x", "y"], [[arena.s(0, 1000)], [arena.s(50, 10)]])
    assert errors(res) == [None, None]
    res = store.get(["y", "nope", "x", "x"], [[arena.d(0, 10)], [arena.d(100, 1)], [arena.d(200, 999)],
                                              [arena.d(2000, 1000)]])
    assert errors(res) == [None, KeyNotFound, SizeMismatch, None]
    assert np.array_equal(arena.dst[:10], arena.src[50:60])
    assert np.array_equal(arena.dst[2000:3000], arena.src[:1000])
    assert not arena.dst[100:101].any() and not arena.dst[200:1199].any()
    # One value larger than the whole capacity fails alone. (What happens to *other* values after
    # such a failure differs: see test_mooncake_failed_put_evicts_an_unrelated_value.)
    res = store.put(["z", "huge", "w"], [[arena.s(0, 100)], [arena.s(0, CAP), arena.s(CAP, 1)], [arena.s(7, 10)]])
    assert errors(res) == [None, StoreFull, None] and res[1].nbytes == CAP + 1
    assert store.exists(["huge"]) == [False]


def put_until_stored(store, key: str, segs, timeout_s: float = 5.0):
    """Put, retrying while the store answers StoreFull: the embedded store makes room inside the
    put, Mooncake's master evicts in the background (within ~50 ms here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        (r,) = store.put([key], [segs])
        if not isinstance(r.error, StoreFull) or time.monotonic() > deadline:
            return r
        time.sleep(0.02)


def test_capacity_eviction_keeps_recently_used(store, arena):
    """Put 20 MiB into 16 MiB after reading the oldest key: both stores stay within capacity,
    keep the recently read key (embedded: strict LRU; Mooncake: a read leases the value and
    eviction takes the oldest lease-expired values first), drop the least recently used one, and
    every survivor reads back exactly."""
    n, total = CAP // MiB, CAP // MiB + 4
    offs = [i * 4099 for i in range(total)]
    for i in range(n - 2):  # 14 MiB: below Mooncake's 90 % eviction watermark
        assert store.put([f"k{i}"], [[arena.s(offs[i], MiB)]])[0].ok
    assert store.get(["k0"], [[arena.d(0, MiB)]])[0].ok
    for i in range(n - 2, total):
        r = put_until_stored(store, f"k{i}", [arena.s(offs[i], MiB)])
        assert r.ok, r
    present = store.exists([f"k{i}" for i in range(total)])
    assert present[0] and not present[1] and present[-1], present
    assert sum(present) * MiB <= CAP
    for i in (i for i, p in enumerate(present) if p):
        assert store.get([f"k{i}"], [[arena.d(0, MiB)]])[0].ok
        assert np.array_equal(arena.dst[:MiB], arena.src[offs[i]:offs[i] + MiB]), i


def test_bad_input(store, arena):
    with pytest.raises(ValueError, match="2 keys but 1"):
        store.put(["a", "b"], [[arena.s(0, 1)]])
    with pytest.raises(ValueError, match="no segments"):
        store.get(["a"], [[]])
    with pytest.raises(ValueError, match="key 5"):
        store.exists([5])
    with pytest.raises(ValueError, match="segment"):
        store.put(["a"], [[(arena.src.ctypes.data, 0)]])


BAD_SEGMENTS = [  # (ptr, nbytes) that cannot be user memory: each used to reach memmove / Mooncake
    ((True, 8), "pointer True is a bool"),
    ((1 << 70, 8), "outside the address space"),
    (((1 << 56) - 4, 8), "outside the address space"),  # starts inside, ends past 2**56
    ((0, 8), "outside the address space"),
    ((-4096, 8), "outside the address space"),
    (("0x1000", 8), "pointer '0x1000' is a str"),
    ((4096, True), "nbytes True is a bool"),
    ((4096, -1), "outside the address space"),
    ((4096, 2.0), "nbytes 2.0 is a float"),
]


@pytest.mark.parametrize("bad,why", BAD_SEGMENTS, ids=[w for _, w in BAD_SEGMENTS])
def test_bad_pointers_rejected_before_memory_is_touched(store, arena, bad, why):
    """Bools and integers outside (0, 2**56] are refused with the argument, item index and allowed
    range named (they used to segfault the process), for every operation that takes addresses;
    a valid item before the bad one is not stored either."""
    good = [arena.s(0, 8)]
    for op in (store.put, store.get):
        with pytest.raises(ValueError, match=rf"buffers\[1\]\[1\] \(key 'b'\).*{why}.*allowed: 0 < ptr"):
            op(["a", "b"], [good, [arena.d(0, 8), bad]])
    assert store.exists(["a", "b"]) == [False, False]
    with pytest.raises(ValueError, match=rf"register_buffer.*{why}"):
        store.register_buffer(*bad)


def test_bare_string_keys_are_refused(store, arena):
    """A str is a sequence of characters: ``exists("ab")`` used to answer for keys "a" and "b"."""
    with pytest.raises(ValueError, match=r"exists: keys must be a list of str, got a str \(one key is \['ab'\]\)"):
        store.exists("ab")
    with pytest.raises(ValueError, match="put: keys must be a list of str, got a str"):
        store.put("ab", [[arena.s(0, 1)], [arena.s(1, 1)]])
    with pytest.raises(ValueError, match="remove: keys must be a list of str, got a bytes"):
        store.remove(b"ab")
    with pytest.raises(ValueError, match=r"segment \d+ at buffers\[0\]\[0\] \(key 'a'\) is not a \(ptr, nbytes\)"):
        store.get(["a"], [arena.d(0, 1)])  # one key's segment, not wrapped in a list
    assert store.exists(["a", "b"]) == [False, False]


# ---- embedded only: strict LRU, threads, factory ----------------------------------------------


def test_embedded_strict_lru_order(arena):
    s = EmbeddedStore(capacity_bytes=4096)
    for i in range(4):
        s.put([f"k{i}"], [[arena.s(i, 1024)]])
    s.get(["k0"], [[arena.d(0, 1024)]])  # k0 becomes most recent: k1 is now the LRU
    s.put(["k4"], [[arena.s(4, 1024)]])
    assert s.exists([f"k{i}" for i in range(5)]) == [True, False, True, True, True]
    s.put(["k2"], [[arena.s(2, 1024)]])  # a put counts as use too: order k3, k0, k4, k2
    s.put(["big"], [[arena.s(0, 2048)]])
    assert s.exists(["k3", "k0", "k4", "k2", "big"]) == [False, False, True, True, True]
    st = s.stats()
    assert (st["evictions"], st["evicted_bytes"], st["used_bytes"], st["num_keys"]) == (3, 3072, 4096, 3)
    assert st["free_bytes"] == 0  # stored + recycled bytes never exceed the capacity


def test_embedded_recycles_arrays_of_dropped_values(arena):
    s = EmbeddedStore(capacity_bytes=8192)
    s.put(["a"], [[arena.s(0, 1024)]])
    s.put(["a"], [[arena.s(1, 1024)]])  # the first array is kept for reuse
    assert s.stats()["free_bytes"] == 1024
    s.put(["b"], [[arena.s(2, 512), arena.s(3, 512)]])  # same size: takes it
    s.remove(["a"])
    s.put(["c"], [[arena.s(4, 1024)]])
    st = s.stats()
    assert (st["recycled"], st["used_bytes"], st["free_bytes"]) == (2, 2048, 0)
    assert s.get(["b", "c"], [[arena.d(0, 1024)], [arena.d(1024, 1024)]])[1].ok
    assert np.array_equal(arena.dst[:1024], arena.value([(2, 512), (3, 512)]))
    assert np.array_equal(arena.dst[1024:2048], arena.src[4:1028])


def test_embedded_oversized_put_keeps_old_value(arena):
    s = EmbeddedStore(capacity_bytes=1000)
    s.put(["k"], [[arena.s(0, 500)]])
    (r,) = s.put(["k"], [[arena.s(0, 1001)]])
    assert isinstance(r.error, StoreFull) and r.nbytes == 1001
    assert s.get(["k"], [[arena.d(0, 500)]])[0].ok and s.stats()["used_bytes"] == 500
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.exists(["k"])


def test_embedded_failed_put_gives_its_reservation_back(arena, monkeypatch):
    """A put whose allocation fails (MemoryError) raises and leaves the capacity as it was: the
    bytes it reserved for its copy are released, so later values are not evicted for them."""
    import hwkv.stores.embedded as emb

    s = EmbeddedStore(capacity_bytes=1000)
    real_empty = emb.np.empty

    def no_memory(*a, **k):
        raise MemoryError

    monkeypatch.setattr(emb.np, "empty", no_memory)
    with pytest.raises(MemoryError):
        s.put(["a"], [[arena.s(0, 600)]])
    monkeypatch.setattr(emb.np, "empty", real_empty)
    assert errors(s.put(["b", "c"], [[arena.s(0, 600)], [arena.s(600, 400)]])) == [None, None]
    assert s.exists(["a", "b", "c"]) == [False, True, True]  # 600 + 400 B fill the 1000 B exactly

def test_embedded_concurrent_use():
    """Threads putting and getting overlapping keys under eviction pressure never see torn values,
    although arrays of dropped values are recycled (never while a get still copies out of one).
    Gets copy in many small segments (each memmove releases the GIL), so they overlap puts."""
    size, cap = 1 << 20, 4 << 20
    s = EmbeddedStore(capacity_bytes=cap)
    bad: list[str] = []

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        src, dst = np.empty(size, np.uint8), np.empty(size, np.uint8)
        for _ in range(200):
            k = int(rng.integers(0, 8))
            if rng.random() < 0.5:
                src[:] = k  # every value of key k is all byte k, whoever wrote it
                s.put([f"k{k}"], [[(src.ctypes.data, size)]])
            else:
                (r,) = s.get([f"k{k}"], [[(dst.ctypes.data + o, 4096) for o in range(0, size, 4096)]])
                if r.ok and not (dst == k).all():
                    bad.append(f"k{k}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    st = s.stats()
    assert bad == [] and st["used_bytes"] == size * st["num_keys"]
    assert st["used_bytes"] + st["free_bytes"] <= cap and st["evictions"] > 0 and st["recycled"] > 0


def test_embedded_small_segment_copies_keep_the_gil():
    """A KV chunk is dozens of small segments. Had each copy released the GIL, every release would
    let a busy Python thread (the engine loop) take it for a whole switch interval (an 8k-token
    get on a GPU host ran past the pool's 10 s load timeout). A long switch interval makes each
    hand-over cost 0.5 s, so a get of 4096 segments finishes in time only if it keeps the GIL."""
    import sys

    n, seg = 4096, 4096
    src = np.arange(n * seg, dtype=np.uint8)
    dst = np.zeros_like(src)
    store = EmbeddedStore(capacity_bytes=2 * n * seg)
    segs = lambda a: [(a.ctypes.data + i * seg, seg) for i in range(n)]  # noqa: E731
    assert store.put(["k"], [segs(src)])[0].ok
    stop = threading.Event()

    def spin() -> None:  # pure Python: gives the GIL up only when asked, after the switch interval
        x = 0
        while not stop.is_set():
            x += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)
    t = threading.Thread(target=spin, daemon=True)
    try:
        t.start()
        t0 = time.perf_counter()
        assert store.get(["k"], [segs(dst)])[0].ok
        took = time.perf_counter() - t0
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join(timeout=10)
    assert np.array_equal(src, dst)
    assert took < 1.6, f"{n} segment copies took {took:.2f} s beside a busy thread (GIL handed over per copy)"


def test_create_store_errors():
    with pytest.raises(ValueError, match="kind='redis'"):
        create_store("redis")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['protocol'\]"):
        create_store("embedded", protocol="tcp")
    with pytest.raises(ValueError, match="capacity_bytes=0"):
        create_store("embedded", capacity_bytes=0)


# ---- Mooncake only ------------------------------------------------------------------------------


@pytest.mark.mooncake
def test_mooncake_background_eviction(mstore, arena):
    """Mooncake never evicts inside a put: a put that finds no space fails with StoreFull, and once
    usage crosses the high watermark (0.9) the master evicts a batch of the values with the oldest
    lease (here: the first ones put) in the background, with no client call involved."""
    s = mstore
    n = CAP // MiB
    for i in range(n):
        assert put_until_stored(s, f"e{i}", [arena.s(i * 4099, MiB)]).ok
    t = time.monotonic()
    r = put_until_stored(s, "after", [arena.s(123, MiB)])  # not exists(): it would lease every key
    assert r.ok and time.monotonic() - t < 5
    survivors = s.exists([f"e{i}" for i in range(n)])
    evicted = survivors.index(True)
    assert 0 < evicted < n and all(survivors[evicted:]), survivors  # a prefix, i.e. oldest first
    for i in range(evicted, n):
        assert s.get([f"e{i}"], [[arena.d(0, MiB)]])[0].ok
        assert np.array_equal(arena.dst[:MiB], arena.src[i * 4099:i * 4099 + MiB])


@pytest.mark.mooncake
def test_mooncake_failed_put_evicts_an_unrelated_value(mooncake, mstore, arena):
    """A put that finds no space makes the master evict eviction_ratio (5 %, at least one) of the
    lease-expired values even when the pool is nearly empty: here the only other value."""
    m, s = mooncake
    assert s.put(["bystander"], [[arena.s(0, 100)]])[0].ok
    before = master_metrics(m)["master_evicted_key_count"]
    (r,) = s.put(["huge"], [[arena.s(0, CAP), arena.s(CAP, 1)]])
    assert isinstance(r.error, StoreFull)
    wait_until(lambda: master_metrics(m)["master_evicted_key_count"] != before, 5)
    assert master_metrics(m)["master_evicted_key_count"] == before + 1
    assert s.exists(["bystander"]) == [False]


@pytest.mark.mooncake
def test_mooncake_pending_eviction_takes_a_later_value(mooncake, mstore, arena):
    """A failed put while nothing is evictable (both values leased) leaves the need-eviction flag
    set: the eviction thread keeps trying, and the first evictable value - one written after the
    failure - is evicted although the pool is nearly empty."""
    m, s = mooncake
    assert all(r.ok for r in s.put(["x", "y"], [[arena.s(0, 1000)], [arena.s(50, 10)]]))
    assert all(r.ok for r in s.get(["x", "y"], [[arena.d(0, 1000)], [arena.d(2000, 10)]]))  # leases, 2 s
    assert isinstance(s.put(["huge"], [[arena.s(0, CAP), arena.s(CAP, 1)]])[0].error, StoreFull)
    before = master_metrics(m)
    attempts, evicted = before["master_attempted_evictions_total"], before["master_evicted_key_count"]
    assert wait_until(lambda: master_metrics(m)["master_attempted_evictions_total"] >= attempts + 2, 1), \
        "the master did not retry the eviction"
    assert master_metrics(m)["master_evicted_key_count"] == evicted  # none evictable
    assert s.put(["later"], [[arena.s(7, 100)]])[0].ok
    assert wait_until(lambda: master_metrics(m)["master_evicted_key_count"] != evicted, 1), \
        "the pending eviction did not happen"
    now = master_metrics(m)
    assert now["master_evicted_key_count"] == evicted + 1
    assert now["master_key_count"] == 2  # x and y, still leased; `exists` would lease "later" too
    assert s.exists(["later"]) == [False]


@pytest.mark.mooncake
def test_mooncake_two_clients_share_the_pool(mooncake, arena):
    m, a = mooncake
    settle(m, a, arena)
    buf = np.zeros(MiB, np.uint8)
    b = create_store("mooncake", master=m.master, metadata_server=m.metadata_server, global_segment_size=0)
    try:
        b.register_buffer(buf.ctypes.data, buf.nbytes)
        assert a.put(["from_a"], [[arena.s(99, 5000)]])[0].ok
        assert b.get(["from_a"], [[(buf.ctypes.data, 5000)]])[0].ok
        assert np.array_equal(buf[:5000], arena.src[99:5099])
        buf[:777] = 7
        assert b.put(["from_b"], [[(buf.ctypes.data, 777)]])[0].ok  # stored on a's segment: b has none
        assert a.get(["from_b"], [[arena.d(0, 777)]])[0].ok and (arena.dst[:777] == 7).all()
        with pytest.raises(ValueError, match="not inside a registered buffer"):
            b.put(["x"], [[arena.s(0, 10)]])  # a's buffers are not b's
    finally:
        b.close()
    assert b.registered_buffers() == []
    with pytest.raises(StoreError, match="closed"):
        b.exists(["from_a"])
    b.close()  # idempotent
    a.clear()


@pytest.mark.mooncake
def test_mooncake_remove_of_leased_value_without_force(mstore, arena):
    s = mstore
    s.put(["leased"], [[arena.s(0, 100)]])
    s.get(["leased"], [[arena.d(0, 100)]])  # a read grants a lease (default_kv_lease_ttl: 2 s here)
    s.force_remove = False
    try:
        (r,) = s.remove(["leased"])
        assert type(r.error) is StoreError and "lease" in str(r.error)
    finally:
        s.force_remove = True
    assert s.remove(["leased"])[0].ok


@pytest.mark.mooncake
def test_mooncake_unreachable_master_fails_fast():
    skip_unless_mooncake()
    t = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"create: mooncake master at 127.0.0.1:\d+ unreachable: Connection ref"):
        create_store("mooncake", master=f"127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    assert time.monotonic() - t < 5
    with pytest.raises(ValueError, match="global_segment_size=1024"):
        create_store("mooncake", master="127.0.0.1:1", global_segment_size=1024)

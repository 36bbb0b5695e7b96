"""Store semantics through ``backend.create_store("embedded")``, with KV blocks as values.

Values are a block's byte segments (all tensors) of the backend's host KV mirror, the memory the
offload and pool connectors hand to stores.
"""

from __future__ import annotations

import unicodedata

import pytest
import torch

from conformance.harness import randn
from hwkv.interfaces import KeyNotFound, KVCache, KVCacheSpec, SizeMismatch, StoreError, StoreFull

pytestmark = pytest.mark.capability("store")
NUM_BLOCKS = 8


def _caches(backend, gen, n: int) -> list[KVCache]:
    caps = backend.capabilities
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    spec = KVCacheSpec(2, NUM_BLOCKS, caps.default_block_size, 2, head, caps.dtypes[0])
    out = [backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True) for _ in range(n)]
    for t in out[0].tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))
    return out


def _block(kv: KVCache, b: int) -> list[tuple[int, int]]:
    return kv.addresses([b])


def _same_block(check, got: KVCache, gb: int, want: KVCache, wb: int, what: str) -> None:
    for ti, (tg, tw) in enumerate(zip(got.tensors, want.tensors)):
        check.exact(tg[gb], tw[wb], "store", f"{what}: tensor {ti}")


def test_put_get_exists_remove(backend, check, gen):
    src, dst = _caches(backend, gen, 2)
    store = backend.create_store("embedded")
    try:
        keys = [f"blk-{b}" for b in (3, 0, 5)]
        res = store.put(keys, [_block(src, b) for b in (3, 0, 5)])
        assert [r.ok for r in res] == [True] * 3, f"put results {res}"
        assert [r.key for r in res] == keys, "results come back one per key, in order"
        assert store.exists([*keys, "missing"]) == [True, True, True, False]
        res = store.get(keys, [_block(dst, b) for b in (1, 2, 7)])
        assert all(r.ok for r in res), f"get results {res}"
        for (sb, db) in ((3, 1), (0, 2), (5, 7)):
            _same_block(check, dst, db, src, sb, f"block {sb} fetched into block {db}")
        untouched = [b for b in range(NUM_BLOCKS) if b not in (1, 2, 7)]
        for t in dst.tensors:
            check.exact(t[untouched], torch.zeros_like(t[untouched]), "store", "get wrote outside its segments")
        # overwrite: the key now holds block 6
        assert store.put(["blk-3"], [_block(src, 6)])[0].ok
        assert store.get(["blk-3"], [_block(dst, 4)])[0].ok
        _same_block(check, dst, 4, src, 6, "overwritten key")
        # typed per-item errors, other items unaffected
        res = store.get(["missing", "blk-0"], [_block(dst, 5), _block(dst, 6)])
        assert isinstance(res[0].error, KeyNotFound) and res[1].ok, f"get results {res}"
        half = [_block(dst, 0)[0]]  # one tensor's segment only: too small for a whole block
        assert isinstance(store.get(["blk-0"], [half])[0].error, SizeMismatch)
        res = store.remove(["blk-0", "missing"])
        assert res[0].ok and isinstance(res[1].error, KeyNotFound), f"remove results {res}"
        assert store.exists(["blk-0", "blk-5"]) == [False, True]
    finally:
        store.close()
    with pytest.raises(StoreError):
        store.exists(["blk-5"])


def test_capacity_lru_and_full(backend, check, gen):
    (src,) = _caches(backend, gen, 1)
    block_bytes = sum(n for _, n in _block(src, 0))
    store = backend.create_store("embedded", capacity_bytes=3 * block_bytes)
    try:
        assert all(r.ok for r in store.put(["a", "b", "c"], [_block(src, b) for b in (0, 1, 2)]))
        assert store.get(["a"], [_block(src, 7)])[0].ok  # "a" becomes most recently used
        assert store.put(["d"], [_block(src, 3)])[0].ok  # evicts the LRU value: "b"
        assert store.exists(["a", "b", "c", "d"]) == [True, False, True, True]
        too_big = _block(src, 4) + _block(src, 5) + _block(src, 6) + _block(src, 1)
        res = store.put(["huge"], [too_big])
        assert isinstance(res[0].error, StoreFull), f"a value larger than the capacity must fail: {res}"
        assert store.exists(["huge"]) == [False]
        _same_block(check, src, 7, src, 0, "value fetched before eviction")
    finally:
        store.close()


BATCH_BLOCKS, STORED = 160, 96  # production-size batches: many existing and missing keys in one call


def test_batched_existing_and_missing(backend, check, gen):
    """One put of 96 keys; get, exists and remove over 128 keys that interleave 96 existing and 32
    missing ones in shuffled order; a put that overwrites half the keys and adds new ones. Every
    result comes back per key, in order; every value lands in its own key's buffer; a missing key's
    buffer is left untouched."""
    caps = backend.capabilities
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    spec = KVCacheSpec(2, BATCH_BLOCKS, caps.default_block_size, 2, head, caps.dtypes[0])
    src, dst = (backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True) for _ in range(2))
    for t in src.tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))
    perm = torch.randperm(BATCH_BLOCKS, generator=gen).tolist()
    stored = perm[:STORED]  # key k-<b> holds block b of src
    store = backend.create_store("embedded", capacity_bytes=64 << 20)
    try:
        res = store.put([f"k-{b}" for b in stored], [_block(src, b) for b in stored])
        assert [r.key for r in res] == [f"k-{b}" for b in stored] and all(r.ok for r in res), \
            f"put of {STORED} keys: {[r for r in res if not r.ok][:3]}"
        missing = [f"missing-{i}" for i in range(32)]
        keys = [f"k-{b}" for b in stored] + missing
        order = torch.randperm(len(keys), generator=gen).tolist()
        keys = [keys[i] for i in order]
        targets = torch.randperm(BATCH_BLOCKS, generator=gen)[: len(keys)].tolist()  # dst block per key
        res = store.get(keys, [_block(dst, b) for b in targets])
        assert [r.key for r in res] == keys, "get results come back one per key, in order"
        bad = [(k, r.error) for k, r in zip(keys, res) if r.ok != k.startswith("k-")]
        assert not bad, f"get of {len(keys)} keys ({len(missing)} missing): wrong outcome for {bad[:3]}"
        assert all(isinstance(r.error, KeyNotFound) for r in res if not r.ok), "a missing key is KeyNotFound"
        want = [torch.zeros_like(t) for t in dst.tensors]
        for k, b in zip(keys, targets):
            if k.startswith("k-"):
                for w, ts in zip(want, src.tensors):
                    w[b] = ts[int(k[2:])]
        for i, (got, w) in enumerate(zip(dst.tensors, want)):
            check.exact(got, w, "store", f"tensor {i} after a get of {len(keys)} keys (missing ones untouched)")
        assert store.exists(keys) == [k.startswith("k-") for k in keys], "exists: one bool per key, in order"
        # overwrite half the stored keys with other blocks, add new keys, in one call
        over = stored[: STORED // 2]
        put_keys = [f"k-{b}" for b in over] + [f"new-{i}" for i in range(BATCH_BLOCKS - STORED - len(over))]
        put_blocks = perm[STORED:]  # blocks no key held before
        res = store.put(put_keys, [_block(src, b) for b in put_blocks])
        assert [r.key for r in res] == put_keys and all(r.ok for r in res), "mixed overwrite/new put"
        res = store.get(put_keys, [_block(dst, b) for b in range(len(put_keys))])
        assert all(r.ok for r in res), f"get after overwrite: {[r for r in res if not r.ok][:3]}"
        for i, b in enumerate(put_blocks):
            _same_block(check, dst, i, src, b, f"key {put_keys[i]} after a batched overwrite")
        gone = keys[::2]
        res = store.remove(gone)
        assert [r.key for r in res] == gone, "remove results come back one per key, in order"
        assert [r.ok for r in res] == [k.startswith("k-") for k in gone], "remove: missing keys are KeyNotFound"
        assert store.exists(keys) == [k.startswith("k-") and k not in gone for k in keys], "exists after remove"
    finally:
        store.close()


# -- suite 3.0: realistic keys, sizes, pressure, clients, mixed batches ------------------------------
def _keys(n: int, tag: str) -> list[str]:
    """Keys as connectors make them and worse: 300-character hex chains that differ only at the end,
    non-ASCII (CJK, Cyrillic, emoji: multi-byte UTF-8) and plain ones."""
    prefix = "model=llama-3-70b/tp=8/" + "0123456789abcdef" * 18  # > 255 bytes before the part that differs
    out = []
    for i in range(n):
        kind = i % 3
        out.append(f"{prefix}/{tag}-{i}" if kind == 0 else f"块-ключ-🔑-{tag}-{i}" if kind == 1 else f"{tag}-{i}")
    return out


def test_keys_sizes_and_mixed_batches(backend, check, gen):
    """Long keys that share a 300-byte prefix, non-ASCII keys; overwrites with a value of another
    size; one get mixing hits, misses and a size mismatch, one put mixing fits and a value too
    large for the store: every item's own result, in order, every hit's bytes in its own buffer."""
    caps = backend.capabilities
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    spec = KVCacheSpec(2, 64, caps.default_block_size, 2, head, caps.dtypes[0])
    src, dst = (backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True) for _ in range(2))
    for t in src.tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))
    block_bytes = sum(n for _, n in _block(src, 0))
    store = backend.create_store("embedded", capacity_bytes=40 * block_bytes)
    try:
        keys = _keys(24, "k")
        res = store.put(keys, [_block(src, b) for b in range(24)])
        assert [r.key for r in res] == keys and all(r.ok for r in res), f"put of long/non-ASCII keys: {res[:3]}"
        # near misses: truncated, extended, re-encoded, and (suite 3.2) differing only in one non-ASCII
        # character, in Unicode normal form or in case: a store that maps keys to ASCII, normalises or
        # case-folds them serves another key's value
        nfc = "café-ключ-" + keys[2]
        assert store.put([nfc], [_block(src, 24)])[0].ok, "put of a key holding 'é' (NFC)"
        near = [keys[0][:-1], keys[1] + "x", keys[1].encode("utf-8").decode("latin-1"), keys[1].replace("块", "键"),
                unicodedata.normalize("NFD", nfc), keys[0].swapcase()]
        assert store.exists(keys + near) == [True] * 24 + [False] * len(near), \
            "exists: a key is its whole string (no truncation, no re-encoding, no normalisation)"
        res = store.get(keys, [_block(dst, b) for b in range(24)])
        assert all(r.ok for r in res), f"get of long/non-ASCII keys: {[r for r in res if not r.ok][:3]}"
        for b in range(24):
            _same_block(check, dst, b, src, b, f"value of key {keys[b][-20:]!r}")
        # overwrite with a value of another size (two blocks), then read it back whole
        two = _block(src, 30) + _block(src, 31)
        assert store.put([keys[3]], [two])[0].ok, "overwrite with a larger value"
        res = store.get([keys[3]], [_block(dst, 40) + _block(dst, 41)])
        assert res[0].ok and res[0].nbytes == 2 * block_bytes, f"get after a resizing overwrite: {res}"
        _same_block(check, dst, 40, src, 30, "first half of the resized value")
        _same_block(check, dst, 41, src, 31, "second half of the resized value")
        assert isinstance(store.get([keys[3]], [_block(dst, 42)])[0].error, SizeMismatch), \
            "a one-block buffer for the two-block value is a SizeMismatch"
        # one get: hits, misses and a size mismatch interleaved
        for t in dst.tensors:
            t.zero_()
        mixed = [keys[0], "nope-1", keys[3], keys[4], "块-nope", keys[5]]
        bufs = [_block(dst, 0), _block(dst, 1), _block(dst, 2), _block(dst, 3), _block(dst, 4), _block(dst, 5)]
        res = store.get(mixed, bufs)
        assert [r.key for r in res] == mixed, "results one per key, in order"
        kinds = [type(r.error).__name__ if r.error else "ok" for r in res]
        assert kinds == ["ok", "KeyNotFound", "SizeMismatch", "ok", "KeyNotFound", "ok"], f"mixed get: {kinds}"
        for db, sb in ((0, 0), (3, 4), (5, 5)):
            _same_block(check, dst, db, src, sb, f"hit into buffer {db} of a mixed batch")
        for db in (1, 4):
            for ti, t in enumerate(dst.tensors):
                check.exact(t[db], torch.zeros_like(t[db]), "store", f"a missing key's buffer {db} (tensor {ti})")
        # one put: fits and a value larger than the whole store
        huge = [seg for b in range(41, 64) for seg in _block(src, b)] + [seg for b in range(0, 18) for seg in
                                                                         _block(src, b)]
        res = store.put(["fits-1", "too-big", "fits-2"], [_block(src, 50), huge, _block(src, 51)])
        assert [r.ok for r in res] == [True, False, True] and isinstance(res[1].error, StoreFull), \
            f"mixed put: {res}"
        assert store.exists(["fits-1", "too-big", "fits-2"]) == [True, False, True]
    finally:
        store.close()


def test_capacity_pressure_and_clients(backend, check, gen):
    """A store of 16 values under a stream of 200 puts and gets from four threads at once (each its
    own keys): every get that succeeds returns its key's latest bytes, the store never holds more
    than its capacity, and the most recently used keys survive; then a single client checks the
    exact LRU order after overwrites (an overwrite counts as use and frees the old bytes)."""
    import threading

    caps = backend.capabilities
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    spec = KVCacheSpec(2, 48, caps.default_block_size, 2, head, caps.dtypes[0])
    src = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True)
    for t in src.tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))
    outs = [backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True) for _ in range(4)]
    block_bytes = sum(n for _, n in _block(src, 0))
    store = backend.create_store("embedded", capacity_bytes=16 * block_bytes)
    errors: list[str] = []
    try:
        def client(c: int) -> None:
            try:
                latest: dict[str, int] = {}
                for step in range(50):
                    key = f"c{c}-键-{step % 7}"
                    blk = (c * 11 + step) % 48
                    r = store.put([key], [_block(src, blk)])[0]
                    if not r.ok:
                        errors.append(f"client {c} put {key}: {r.error!r}")
                        return
                    latest[key] = blk
                    probe = f"c{c}-键-{(step * 3) % 7}"
                    if probe in latest:
                        g = store.get([probe], [_block(outs[c], step % 48)])[0]
                        if g.ok:
                            for ti, (to, ts) in enumerate(zip(outs[c].tensors, src.tensors)):
                                if not torch.equal(to[step % 48], ts[latest[probe]]):
                                    errors.append(f"client {c}: {probe} gave stale or foreign bytes (tensor {ti})")
                        elif not isinstance(g.error, KeyNotFound):
                            errors.append(f"client {c} get {probe}: {g.error!r}")
            except Exception as e:  # reported below: a thread's exception would vanish
                errors.append(f"client {c}: {e!r}")

        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "store calls from four threads did not finish in 60 s"
        assert not errors, f"{len(errors)} errors from concurrent clients: {errors[:3]}"
        live = store.exists([f"c{c}-键-{k}" for c in range(4) for k in range(7)])
        assert 0 < sum(live) <= 16, f"{sum(live)} values live in a store of 16"
    finally:
        store.close()
    store = backend.create_store("embedded", capacity_bytes=4 * block_bytes)
    try:
        assert all(r.ok for r in store.put(["a", "b", "c", "d"], [_block(src, b) for b in range(4)]))
        assert store.put(["a"], [_block(src, 9)])[0].ok  # overwrite: "a" most recent, its old bytes freed
        assert store.put(["e"], [_block(src, 5)])[0].ok  # evicts "b" only
        assert store.exists(["a", "b", "c", "d", "e"]) == [True, False, True, True, True], "LRU after overwrite"
        assert store.get(["c"], [_block(src, 20)])[0].ok  # "c" most recent
        assert all(r.ok for r in store.put(["f", "g"], [_block(src, 6), _block(src, 7)]))  # evict "d", "a"
        assert store.exists(["a", "b", "c", "d", "e", "f", "g"]) == [False, False, True, False, True, True, True]
        _same_block(check, src, 20, src, 2, "value fetched under pressure")
    finally:
        store.close()


def test_readers_never_see_a_half_written_value(backend, check, gen):
    """(3.2) A value becomes visible whole: while one client overwrites a key again and again with two
    values A and B (and puts a new key at the end), another client's gets of it return A or B complete,
    never a mix, and once ``exists`` says True for the new key a get of it returns its whole value. The
    vendor bug: the index entry published before the copy of the value's segments finished."""
    import threading
    import time

    caps = backend.capabilities
    head = 64 if caps.head_sizes is None or 64 in caps.head_sizes else caps.head_sizes[0]
    spec = KVCacheSpec(4, 24, caps.default_block_size, 2, head, caps.dtypes[0])
    src = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True)
    for t in src.tensors:
        t.copy_(randn(gen, *t.shape, dtype=t.dtype))
    out = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout, host=True)
    into = [seg for b in range(12, 16) for seg in _block(out, b)]
    value = lambda b0: [seg for b in range(b0, b0 + 4) for seg in _block(src, b)]  # noqa: E731  4 blocks, 32+ segments
    want = {name: [torch.cat([t[b0:b0 + 4].reshape(-1).view(torch.uint8) for t in src.tensors])]
            for name, b0 in (("A", 0), ("B", 4), ("C", 8))}
    store = backend.create_store("embedded", capacity_bytes=64 * sum(n for _, n in _block(src, 0)))
    errors: list[str] = []
    done = threading.Event()
    try:
        assert store.put(["shared"], [value(0)])[0].ok

        def reader() -> None:
            try:
                seen_new = False
                while not done.is_set() or not seen_new:
                    for key, names in (("shared", ("A", "B")), ("fresh", ("C",))):
                        if key == "fresh":
                            if not store.exists(["fresh"])[0]:
                                if done.is_set():
                                    errors.append("exists('fresh') False after its put returned")
                                    return
                                continue
                            seen_new = True
                        g = store.get([key], [into])[0]
                        if not g.ok:
                            errors.append(f"get {key!r}: {g.error!r}")
                            return
                        got = torch.cat([t[12:16].reshape(-1).view(torch.uint8) for t in out.tensors])
                        if not any(torch.equal(got, want[n][0]) for n in names):
                            errors.append(f"get {key!r} returned bytes that are none of {names} whole")
                            return
            except Exception as e:  # reported below
                errors.append(f"reader: {e!r}")

        t = threading.Thread(target=reader)
        t.start()
        for i in range(30):
            assert store.put(["shared"], [value(4 if i % 2 == 0 else 0)])[0].ok
            time.sleep(0.0005)
        assert store.put(["fresh"], [value(8)])[0].ok
        done.set()
        t.join(timeout=60)
        assert not t.is_alive(), "reader did not finish in 60 s"
        assert not errors, errors[0]
    finally:
        done.set()
        store.close()

"""Transfer and Store mutants: the reference's Mooncake endpoint and embedded store, each wrapped with
one realistic batch-handling mistake."""

from __future__ import annotations

from typing import Any

from conformance.mutants.base import mutant
from hwkv.interfaces import Buffers, ItemResult, KeyNotFound, Transfer
from hwkv.stores.embedded import EmbeddedStore

XFER = ("test_transfer",)
STORE = ("test_store.py::test_batched", "test_store.py")
MIB4 = 4 << 20


class _Transfer(Transfer):
    """Delegates to the real endpoint; ``segments`` rewrites each (local, remote, length) batch."""

    def __init__(self, inner: Transfer):
        self.inner, self.protocol = inner, inner.protocol

    def __getattr__(self, name: str) -> Any:  # the endpoint's extras (``orders_after``, ...) pass through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def segments(self, local: list[int], remote: list[int], lengths: list[int]) -> tuple[list[int], ...]:
        return local, remote, lengths

    def endpoint(self) -> str:
        return self.inner.endpoint()

    def register(self, ptr: int, nbytes: int) -> None:
        self.inner.register(ptr, nbytes)

    def probe(self, peer: str) -> None:
        self.inner.probe(peer)

    def unregister(self, ptr: int) -> None:
        self.inner.unregister(ptr)

    # ``**options``: what the endpoint takes beyond the interface (a direct mover's ``after=event``)
    def submit_write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int],
                     **options: Any) -> int:
        return self.inner.submit_write(peer, *self.segments(src_ptrs, dst_ptrs, lengths), **options)

    def submit_read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int],
                    **options: Any) -> int:
        return self.inner.submit_read(peer, *self.segments(local_ptrs, remote_ptrs, lengths), **options)

    def write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        self.inner.write(peer, *self.segments(src_ptrs, dst_ptrs, lengths))

    def read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> None:
        self.inner.read(peer, *self.segments(local_ptrs, remote_ptrs, lengths))

    def poll(self, batch: int) -> bool:
        return self.inner.poll(batch)

    def close(self) -> None:
        self.inner.close()


def _transfer(name: str, **methods: Any) -> Any:
    return type(f"Transfer_{name}", (_Transfer,), methods)


def _coalesce_local(self: Any, local: list[int], remote: list[int], lengths: list[int]) -> tuple[list[int], ...]:
    """BUG: merges segments adjacent in local memory, assuming the remote side is adjacent too."""
    lo, re, ln = [local[0]], [remote[0]], [lengths[0]]
    for p, r, n in zip(local[1:], remote[1:], lengths[1:]):
        if p == lo[-1] + ln[-1]:
            ln[-1] += n
        else:
            lo.append(p), re.append(r), ln.append(n)
    return lo, re, ln


def _sorted_local(self: Any, local: list[int], remote: list[int], lengths: list[int]) -> tuple[list[int], ...]:
    order = sorted(range(len(local)), key=lambda i: local[i])
    return [local[i] for i in order], list(remote), [lengths[i] for i in order]  # BUG: remote not permuted


def _async_first_64(self: Any, peer: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
    """BUG: submit splits the batch into sub-batches of 64 segments and submits the first one only."""
    return self.inner.submit_write(peer, src[:64], dst[:64], lengths[:64])


def _register_capped(self: Any, ptr: int, nbytes: int) -> None:
    self.inner.register(ptr, min(nbytes, MIB4))  # BUG: a 4 MiB registration limit, silently applied


mutant("xfer-segment-cap-4mib", "transfer", "segments longer than 4 MiB silently truncated to 4 MiB", XFER,
       transfer=_transfer("cap", segments=lambda self, lo, re, ln: (lo, re, [min(n, MIB4) for n in ln])))
mutant("xfer-segment-limit-64", "transfer", "at most 64 segments per call; the rest silently dropped", XFER,
       transfer=_transfer("limit", segments=lambda self, lo, re, ln: (lo[:64], re[:64], ln[:64])))
mutant("xfer-last-segment-dropped", "transfer", "the last segment of every call dropped (off-by-one)", XFER,
       transfer=_transfer("last", segments=lambda self, lo, re, ln: (lo[:-1], re[:-1], ln[:-1])))
mutant("xfer-coalesce-local-only", "transfer", "segments merged when adjacent locally, remote adjacency assumed",
       XFER, transfer=_transfer("coalesce", segments=_coalesce_local))
mutant("xfer-sorted-local-only", "transfer", "segments sorted by local address without permuting the remote side",
       XFER, transfer=_transfer("sorted", segments=_sorted_local))
mutant("xfer-async-partial-batch", "transfer", "submit_write submits only the first sub-batch of 64 segments", XFER,
       transfer=_transfer("async", submit_write=_async_first_64))
mutant("xfer-register-cap-4mib", "transfer", "register() silently caps a registration at 4 MiB", XFER,
       transfer=_transfer("register", register=_register_capped))


class _Store(EmbeddedStore):
    pass


def _get_stops_at_missing(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: the batch aborts at the first missing key; the rest are reported missing too."""
    out = EmbeddedStore.get(self, keys, buffers)
    miss = next((i for i, r in enumerate(out) if not r.ok), len(out))
    return out[:miss] + [ItemResult(k, 0, KeyNotFound(f"key {k!r} not found")) for k in keys[miss:]]


def _get_compacted(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: missing keys filtered out first, then the found keys zipped with the buffers in order."""
    with self._lock:
        found = [k for k in keys if k in self._values]
    res = {r.key: r for r in EmbeddedStore.get(self, found, buffers[: len(found)])} if found else {}
    return [res.get(k) or ItemResult(k, 0, KeyNotFound(f"key {k!r} not found")) for k in keys]


def _put_limit_32(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: a fixed 32-entry batch: later items are acknowledged but never stored."""
    out = EmbeddedStore.put(self, keys[:32], buffers[:32])
    return out + [ItemResult(k, sum(n for _, n in b)) for k, b in zip(keys[32:], buffers[32:])]


def _put_keeps_old(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: an existing key keeps its old value (put-if-absent), acknowledged as written."""
    with self._lock:
        old = [k in self._values for k in keys]
    new = [(k, b) for k, b, o in zip(keys, buffers, old) if not o]
    res = {r.key: r for r in EmbeddedStore.put(self, [k for k, _ in new], [b for _, b in new])} if new else {}
    return [res.get(k) or ItemResult(k, sum(n for _, n in b)) for k, b in zip(keys, buffers)]


_STORE = {
    "store-get-stops-at-missing": ("get aborts the batch at the first missing key", {"get": _get_stops_at_missing}),
    "store-get-compacts-missing": ("get drops missing keys, then zips found keys with the buffers in order",
                                   {"get": _get_compacted}),
    "store-exists-sorted": ("exists answers for the keys in sorted order",
                            {"exists": lambda self, keys: EmbeddedStore.exists(self, sorted(keys))}),
    "store-put-limit-32": ("put stores at most 32 items per call, acknowledges all", {"put": _put_limit_32}),
    "store-put-keeps-old": ("put on an existing key keeps the old value (stale), acknowledged",
                            {"put": _put_keeps_old}),
    "store-remove-missing-ok": ("remove of a missing key reports success",
                                {"remove": lambda self, keys: [ItemResult(r.key, r.nbytes) for r in
                                                               EmbeddedStore.remove(self, keys)]}),
    "store-results-sorted": ("get results returned sorted by key",
                             {"get": lambda self, keys, bufs: sorted(EmbeddedStore.get(self, keys, bufs),
                                                                     key=lambda r: r.key)}),
}
for _name, (_bug, _methods) in _STORE.items():
    mutant(_name, "store", _bug, STORE, store=type(f"Store_{_name}", (_Store,), _methods))


# -- suite 3.0 -----------------------------------------------------------------------------------------
XFER3 = ("test_transfer_lengths_offsets",)
STORE3 = ("test_store.py::test_keys_sizes",)
mutant("xfer-length-vector-8", "transfer", "lengths rounded down to a multiple of 8 bytes (a vectorised copy drops "
       "the tail)", XFER3, transfer=_transfer("vec8", segments=lambda self, lo, re, ln: (lo, re, [n - n % 8 or 8
                                                                                                for n in ln])))
mutant("xfer-segment-cap-64mib", "transfer", "segments longer than 64 MiB silently truncated to 64 MiB", XFER3,
       transfer=_transfer("cap64", segments=lambda self, lo, re, ln: (lo, re, [min(n, 64 << 20) for n in ln])))


def _trunc(keys: list[str]) -> list[str]:
    return [k.encode("utf-8")[:255].decode("utf-8", "ignore") for k in keys]  # BUG: a 255-byte key field


def _ascii(keys: list[str]) -> list[str]:
    return [k.encode("ascii", "ignore").decode() or "_" for k in keys]  # BUG: keys stored as ASCII


for _name, _bug, _fix in (("store-key-255-bytes", "keys truncated to 255 bytes (a fixed key field)", _trunc),
                          ("store-key-ascii", "keys stored as ASCII, other characters dropped", _ascii)):
    mutant(_name, "store", _bug, STORE3, store=type(f"Store_{_name}", (_Store,), {
        "put": lambda self, keys, bufs, f=_fix: EmbeddedStore.put(self, f(keys), bufs),
        "get": lambda self, keys, bufs, f=_fix: EmbeddedStore.get(self, f(keys), bufs),
        "exists": lambda self, keys, f=_fix: EmbeddedStore.exists(self, f(keys)),
        "remove": lambda self, keys, f=_fix: EmbeddedStore.remove(self, f(keys))}))


def _keep_order(call: Any) -> Any:
    """``call`` with the LRU order it leaves undone for keys that existed before (a store that tracks
    recency at insertion only): BUG."""

    def wrapped(self: Any, keys: list[str], *rest: Any) -> Any:
        with self._lock:
            before = list(self._values)
        out = call(self, keys, *rest)
        with self._lock:
            for k in reversed(before):  # the old keys back in their old order, ahead of new ones
                if k in self._values:
                    self._values.move_to_end(k, last=False)
        return out

    return wrapped


STORE_LRU = ("test_store.py::test_capacity_pressure_and_clients",)
mutant("store-get-no-recency", "store", "get does not count as use: eviction in insertion order (FIFO), not LRU",
       STORE_LRU, store=type("Store_get_fifo", (_Store,), {"get": _keep_order(EmbeddedStore.get)}))
mutant("store-overwrite-keeps-position", "store", "an overwrite keeps the key's old LRU position (a put on an existing "
       "key is not a use)", STORE_LRU, store=type("Store_put_pos", (_Store,), {"put": _keep_order(EmbeddedStore.put)}))


# -- suite 3.0, the transfer and store clauses that had no mutant of their own --------------------
mutant("xfer-segment-limit-2048", "transfer", "a fixed 2,048-entry descriptor table: segments past the 2,048th of a "
       "call silently dropped", XFER3,
       transfer=_transfer("limit2048", segments=lambda self, lo, re, ln: (lo[:2048], re[:2048], ln[:2048])))
mutant("xfer-remote-aligned-64", "transfer", "remote addresses aligned down to 64 B (a DMA engine's alignment applied "
       "silently: offsets inside a registered region lose their low bits)", XFER3,
       transfer=_transfer("align64", segments=lambda self, lo, re, ln: (lo, [r - r % 64 for r in re], ln)))


def _submit_in_queue(kind: str) -> Any:
    """BUG: a completion queue two batches deep: a batch submitted while two others are still in flight
    is acknowledged with an id of its own but never queued (its poll says done at once)."""

    def submit(self: Any, peer: str, a: list[int], b: list[int], lengths: list[int], **options: Any) -> int:
        live = self.__dict__.setdefault("_live", set())
        if len(live) >= 2:
            self.__dict__["_dropped"] = self.__dict__.get("_dropped", 0) - 1
            return self._dropped  # negative: never a real batch id
        batch = getattr(self.inner, f"submit_{kind}")(peer, a, b, lengths, **options)
        live.add(batch)
        return batch

    return submit


def _poll_in_queue(self: Any, batch: int) -> bool:
    if batch < 0:
        return True  # the dropped batch "completed"
    done = self.inner.poll(batch)
    if done:
        self.__dict__.setdefault("_live", set()).discard(batch)
    return done


mutant("xfer-inflight-limit-2", "transfer", "a completion queue two batches deep: a third batch in flight is "
       "acknowledged but never run", XFER3,
       transfer=_transfer("inflight2", submit_write=_submit_in_queue("write"), submit_read=_submit_in_queue("read"),
                          poll=_poll_in_queue))


def _put_stops_at_full(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: the batch aborts at the first value that does not fit; the items after it are reported full
    and never stored."""
    out: list[ItemResult] = []
    for i, (k, b) in enumerate(zip(keys, buffers)):
        r = EmbeddedStore.put(self, [k], [b])[0]
        out.append(r)
        if not r.ok:
            return out + [ItemResult(k2, sum(n for _, n in b2), r.error) for k2, b2 in zip(keys[i + 1:],
                                                                                        buffers[i + 1:])]
    return out


def _get_copies_what_fits(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: a value of another size than the buffers is copied as far as both reach and reported a hit."""
    out = []
    for k, segs in zip(keys, buffers):
        with self._lock:
            value = self._values.get(k)
        want = sum(n for _, n in segs)
        if value is None or value.nbytes == want:
            out += EmbeddedStore.get(self, [k], [segs])
            continue
        import ctypes

        off = 0
        for ptr, n in segs:
            m = max(0, min(n, value.nbytes - off))
            ctypes.memmove(ptr, value.ctypes.data + off, m)
            off += n
        out.append(ItemResult(k, want))
    return out


def _put_leaks_overwritten(self: Any, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
    """BUG: an overwrite never gives the old value's bytes back to the capacity account, so the store
    evicts live values early."""
    with self._lock:
        old = sum(self._values[k].nbytes for k in set(keys) if k in self._values)
    out = EmbeddedStore.put(self, keys, buffers)
    with self._lock:
        self._used += old
    return out


mutant("store-put-stops-at-full", "store", "put aborts the batch at the first value that does not fit: the items "
       "after it are reported full and not stored", STORE3,
       store=type("Store_put_stops", (_Store,), {"put": _put_stops_at_full}))
mutant("store-get-size-mismatch-copied", "store", "a get into buffers of another size than the value copies what "
       "fits and reports a hit", STORE3, store=type("Store_get_fits", (_Store,), {"get": _get_copies_what_fits}))
mutant("store-overwrite-leaks-bytes", "store", "an overwrite does not give the old value's bytes back to the capacity "
       "account (live values evicted early)", STORE_LRU,
       store=type("Store_put_leak", (_Store,), {"put": _put_leaks_overwritten}))

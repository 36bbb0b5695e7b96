"""EmbeddedStore: the in-process KV pool — a byte-capacity LRU of host copies."""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

from hwkv.interfaces.store import (
    Buffers,
    ItemResult,
    KeyNotFound,
    SizeMismatch,
    Store,
    StoreError,
    StoreFull,
    check_batch,
)

# ctypes.memmove releases the GIL around every call. A get or put of a KV chunk is dozens of small
# segments (one per layer and K/V), and while another thread runs Python (the engine loop) every
# release costs a GIL hand-over: measured here, 512 x 32 KiB copies took 305 ms instead of 1.8 ms
# with a spinning thread beside them (an 8k-token Llama-1B get, 16k segments, ran past the pool's
# 10 s load timeout on an H100 host). Small copies therefore keep the GIL (a few microseconds each);
# large ones release it so the engine thread runs during them.
_memmove_holding_gil = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes.cast(ctypes.memmove, ctypes.c_void_p).value)
GIL_COPY_MAX = 1 << 20


def copy_bytes(dst: int, src: int, n: int) -> None:
    """``memmove(dst, src, n)``; copies of at most ``GIL_COPY_MAX`` bytes hold the GIL."""
    (_memmove_holding_gil if n <= GIL_COPY_MAX else ctypes.memmove)(dst, src, n)


class EmbeddedStore(Store):
    """In-process store holding at most ``capacity_bytes`` of values.

    * ``put`` copies the segments into one host array (``copy_bytes``, no intermediate bytes
      objects) and makes room by evicting least-recently used values; a value larger than the whole
      capacity fails with :class:`StoreFull` and leaves any old value of the key in place.
    * ``get`` copies into the caller's segments; ``get`` and ``put`` count as use, ``exists`` does not.
    * Thread-safe: the index is guarded by a lock; copies run outside it.
    * Arrays of evicted/removed/overwritten values are recycled for later values of the same size
      (fresh memory costs page faults: ~3x slower puts), but only once no reader is copying out
      of them; stored, recycled and in-flight bytes never exceed the capacity (eviction happens
      before the copy, so a full store writes new values into its victims' arrays).
    * No registration is needed; ``register_buffer`` only checks its range.
    """

    def __init__(self, capacity_bytes: int = 1 << 30):
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes!r} is invalid (need an int >= 1)")
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, np.ndarray] = OrderedDict()  # LRU first
        self._used = 0
        self._free: dict[int, list[np.ndarray]] = {}  # nbytes -> arrays ready for reuse
        self._free_bytes = 0
        self._reserved = 0  # bytes of puts copying right now
        self._readers: dict[int, int] = {}  # id(array) -> gets copying out of it right now
        self._retired: set[int] = set()  # ids of arrays dropped while being read
        self._lock = threading.Lock()
        self._closed = False
        self._stats = dict.fromkeys(
            ("puts", "put_full", "gets", "hits", "misses", "evictions", "evicted_bytes", "recycled"), 0
        )

    def _open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    def _retire(self, arr: np.ndarray) -> None:
        """Under the lock: ``arr`` left the index; recycle it unless a get still reads it."""
        self._used -= arr.nbytes
        if self._readers.get(id(arr)):
            self._retired.add(id(arr))
        else:
            self._recycle(arr)

    def _recycle(self, arr: np.ndarray) -> None:
        self._free.setdefault(arr.nbytes, []).append(arr)
        self._free_bytes += arr.nbytes
        self._trim()

    def _evict(self, nbytes: int) -> None:
        """Under the lock: drop LRU values until ``nbytes`` more fit beside stored and reserved bytes."""
        while self._values and self._used + self._reserved + nbytes > self.capacity_bytes:
            _, victim = self._values.popitem(last=False)
            self._stats["evictions"] += 1
            self._stats["evicted_bytes"] += victim.nbytes
            self._retire(victim)

    def _take_free(self, nbytes: int) -> np.ndarray | None:
        pool = self._free.get(nbytes)
        if not pool:
            return None
        self._free_bytes -= nbytes
        self._stats["recycled"] += 1
        arr = pool.pop()
        if not pool:
            del self._free[nbytes]
        return arr

    def _trim(self) -> None:
        while self._free and self._used + self._reserved + self._free_bytes > self.capacity_bytes:
            n = max(self._free)
            self._free[n].pop()
            self._free_bytes -= n
            if not self._free[n]:
                del self._free[n]

    def put(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
        check_batch("put", keys, buffers)
        self._open()
        out = []
        for key, segs in zip(keys, buffers):
            total = sum(n for _, n in segs)
            if total > self.capacity_bytes:
                with self._lock:
                    self._stats["put_full"] += 1
                err = StoreFull(f"key {key!r}: {total} B exceeds the capacity of {self.capacity_bytes} B")
                out.append(ItemResult(key, total, err))
                continue
            with self._lock:
                # Make room before copying, so a full store reuses its victims' arrays.
                old = self._values.get(key)
                self._evict(total - (old.nbytes if old is not None else 0))
                self._reserved += total
                value = self._take_free(total)
                self._trim()
            try:
                if value is None:
                    value = np.empty(total, dtype=np.uint8)
                base, off = value.ctypes.data, 0
                for ptr, n in segs:
                    copy_bytes(base + off, ptr, n)
                    off += n
            except BaseException:  # e.g. MemoryError: give the reservation (and the array) back
                with self._lock:
                    self._reserved -= total
                    if value is not None:
                        self._recycle(value)
                raise
            with self._lock:
                self._reserved -= total
                old = self._values.pop(key, None)
                if old is not None:
                    self._retire(old)
                self._evict(total)  # concurrent puts may have taken the room made above
                self._values[key] = value
                self._used += total
                self._trim()
                self._stats["puts"] += 1
            out.append(ItemResult(key, total))
        return out

    def get(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
        check_batch("get", keys, buffers)
        self._open()
        out = []
        for key, segs in zip(keys, buffers):
            want = sum(n for _, n in segs)
            with self._lock:
                self._stats["gets"] += 1
                value = self._values.get(key)
                if value is not None and value.nbytes == want:
                    self._values.move_to_end(key)
                    self._readers[id(value)] = self._readers.get(id(value), 0) + 1
                    self._stats["hits"] += 1
                else:
                    self._stats["misses"] += 1
            if value is None:
                out.append(ItemResult(key, 0, KeyNotFound(f"key {key!r} not found")))
                continue
            if value.nbytes != want:
                err = SizeMismatch(f"key {key!r}: stored {value.nbytes} B, buffers hold {want} B")
                out.append(ItemResult(key, value.nbytes, err))
                continue
            base, off = value.ctypes.data, 0
            for ptr, n in segs:
                copy_bytes(ptr, base + off, n)
                off += n
            with self._lock:
                i = id(value)
                self._readers[i] -= 1
                if not self._readers[i]:
                    del self._readers[i]
                    if i in self._retired:  # dropped from the index while we copied: recycle now
                        self._retired.discard(i)
                        self._recycle(value)
            out.append(ItemResult(key, want))
        return out

    def exists(self, keys: list[str]) -> list[bool]:
        check_batch("exists", keys)
        self._open()
        with self._lock:
            return [k in self._values for k in keys]

    def remove(self, keys: list[str]) -> list[ItemResult]:
        check_batch("remove", keys)
        self._open()
        out = []
        with self._lock:
            for key in keys:
                value = self._values.pop(key, None)
                if value is None:
                    out.append(ItemResult(key, 0, KeyNotFound(f"key {key!r} not found")))
                else:
                    self._retire(value)
                    out.append(ItemResult(key, value.nbytes))
        return out

    def stats(self) -> dict[str, int]:
        """Counters plus ``capacity_bytes``, ``used_bytes`` (stored values), ``free_bytes`` (arrays
        kept for reuse) and ``num_keys``."""
        with self._lock:
            return {**self._stats, "capacity_bytes": self.capacity_bytes, "used_bytes": self._used,
                    "free_bytes": self._free_bytes, "num_keys": len(self._values)}

    def close(self) -> None:
        with self._lock:
            self._values.clear()
            self._free.clear()
            self._used = self._free_bytes = 0
            self._closed = True

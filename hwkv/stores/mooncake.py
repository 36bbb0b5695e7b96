"""MooncakeStore: the Store contract over ``mooncake.store.MooncakeDistributedStore``.

A client of a Mooncake cluster: it contributes ``global_segment_size`` bytes of this host's memory
to the pool, and puts/gets values that may live on any client's segment. A running
``mooncake_master`` is required (see ``docs/stores-and-transfer.md`` and
:func:`hwkv.testing.mooncake.mooncake_master`).
"""

from __future__ import annotations

import contextlib
import socket
import threading

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
from hwkv.transfer.mooncake import PROTOCOLS, Registrations, load_mooncake

MIN_SEGMENT = 16 << 20  # the wheel refuses smaller global segments ("Total size must be at least 16777216")
# Mooncake ErrorCode values the adapter maps (mooncake-store/include/types.h).
NO_SPACE = {-10: "BUFFER_OVERFLOW", -200: "NO_AVAILABLE_HANDLE", -1700: "TENANT_QUOTA_EXCEEDED"}
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE = -704, -706


def _error(op: str, key: str, code: int) -> StoreError:
    if code in NO_SPACE:
        return StoreFull(f"{op} {key!r}: no space in the pool ({NO_SPACE[code]}, code {code})")
    if code == OBJECT_NOT_FOUND:
        return KeyNotFound(f"key {key!r} not found")
    if code == OBJECT_HAS_LEASE:
        return StoreError(f"{op} {key!r}: the value is leased to a reader (code {code}); retry after the lease ttl")
    return StoreError(f"{op} {key!r}: mooncake error code {code}")


class MooncakeStore(Store):
    """Store backed by a Mooncake cluster.

    Semantics versus the contract (and :class:`~hwkv.stores.embedded.EmbeddedStore`):

    * Every segment passed to ``put``/``get`` must lie inside a buffer given to
      :meth:`register_buffer` (zero-copy: Mooncake moves the bytes straight between registered
      memory and the pool). This is checked here (``ValueError``) on every protocol; the tcp
      transport alone would not notice, rdma would fail.
    * ``put`` overwrites: single-segment values via ``batch_upsert_from``; multi-segment values are
      removed (forced) first, then written with ``batch_put_from_multi_buffers`` (Mooncake's plain
      put silently keeps an existing value). A failed overwrite may leave the key absent.
    * Capacity: the pool is the sum of all clients' segments. A put that finds no space fails at
      once with :class:`StoreFull`; the master evicts in the background once usage crosses its
      ``eviction_high_watermark_ratio`` — objects whose lease (granted by reads) expired first, in
      batches of ``eviction_ratio``. That is approximately, not strictly, LRU.
    * ``remove`` is forced by default (``force_remove``): a value being read (leased) is removed
      anyway; with ``force_remove=False`` it fails with a :class:`StoreError` naming the lease.
    """

    def __init__(
        self,
        master: str,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        host: str = "127.0.0.1",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 0,
        device_name: str = "",
        force_remove: bool = True,
        connect_timeout_s: float = 3.0,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not supported (allowed: {', '.join(PROTOCOLS)})")
        gss = global_segment_size
        if not isinstance(gss, int) or not (gss == 0 or gss >= MIN_SEGMENT):
            raise ValueError(f"global_segment_size={global_segment_size!r} is invalid "
                             f"(need 0 for a client that contributes no memory, or >= {MIN_SEGMENT})")
        if not isinstance(local_buffer_size, int) or local_buffer_size < 0:
            raise ValueError(f"local_buffer_size={local_buffer_size!r} is invalid (need an int >= 0)")
        mhost, _, mport = master.rpartition(":")
        if not mhost or not mport.isdigit():
            raise ValueError(f"master={master!r} is invalid (need 'host:port' of mooncake_master's RPC port)")
        store_mod = load_mooncake("store")
        # setup() retries an unreachable master forever, so fail fast here instead.
        try:
            socket.create_connection((mhost, int(mport)), timeout=connect_timeout_s).close()
        except OSError as e:
            raise StoreError(f"cannot reach mooncake_master at {master} ({e}); is it running?") from e
        self.capacity_bytes = global_segment_size
        self.protocol = protocol
        self.force_remove = force_remove
        self._store = store_mod.MooncakeDistributedStore()
        rc = self._store.setup(host, metadata_server, global_segment_size, local_buffer_size, protocol,
                               device_name, master)
        if rc != 0:
            with contextlib.suppress(Exception):
                self._store.close()
            raise StoreError(f"MooncakeDistributedStore.setup(master={master!r}, metadata_server={metadata_server!r}, "
                             f"protocol={protocol!r}) failed with code {rc}")
        self._regs = Registrations()
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(("puts", "put_full", "gets", "hits", "misses"), 0)

    def _live(self):
        if self._store is None:
            raise StoreError("store is closed")
        return self._store

    def _check_registered(self, op: str, buffers: list[Buffers]) -> None:
        with self._lock:
            for segs in buffers:
                for ptr, n in segs:
                    if not self._regs.covers(ptr, n):
                        raise ValueError(f"{op}: segment ({ptr:#x}, {n}) is not inside a registered buffer "
                                         "(call register_buffer first)")

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        store = self._live()
        with self._lock:
            self._regs.register(ptr, nbytes, store.register_buffer, StoreError, "register_buffer")

    def unregister_buffer(self, ptr: int) -> None:
        store = self._live()
        with self._lock:
            self._regs.unregister(ptr, store.unregister_buffer, StoreError, "unregister_buffer")

    def registered_buffers(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every registered buffer (empty after ``close``)."""
        return self._regs.items()

    def put(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
        check_batch("put", keys, buffers)
        store = self._live()
        self._check_registered("put", buffers)
        codes: dict[int, int] = {}
        single = [i for i, segs in enumerate(buffers) if len(segs) == 1]
        multi = [i for i, segs in enumerate(buffers) if len(segs) > 1]
        if single:
            rcs = store.batch_upsert_from([keys[i] for i in single], [buffers[i][0][0] for i in single],
                                          [buffers[i][0][1] for i in single])
            codes.update(zip(single, rcs))
        if multi:
            mkeys = [keys[i] for i in multi]
            store.batch_remove(mkeys, True)  # missing keys answer OBJECT_NOT_FOUND, which is fine here
            rcs = store.batch_put_from_multi_buffers(mkeys, [[p for p, _ in buffers[i]] for i in multi],
                                                     [[n for _, n in buffers[i]] for i in multi])
            codes.update(zip(multi, rcs))
        out = []
        for i, (key, segs) in enumerate(zip(keys, buffers)):
            total = sum(n for _, n in segs)
            out.append(ItemResult(key, total, None if codes[i] == 0 else _error("put", key, codes[i])))
        with self._lock:
            self._stats["puts"] += sum(r.ok for r in out)
            self._stats["put_full"] += sum(isinstance(r.error, StoreFull) for r in out)
        return out

    def get(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
        check_batch("get", keys, buffers)
        store = self._live()
        self._check_registered("get", buffers)
        codes: dict[int, int] = {}
        single = [i for i, segs in enumerate(buffers) if len(segs) == 1]
        multi = [i for i, segs in enumerate(buffers) if len(segs) > 1]
        if single:
            rcs = store.batch_get_into([keys[i] for i in single], [buffers[i][0][0] for i in single],
                                       [buffers[i][0][1] for i in single])
            codes.update(zip(single, rcs))
        if multi:
            rcs = store.batch_get_into_multi_buffers([keys[i] for i in multi],
                                                     [[p for p, _ in buffers[i]] for i in multi],
                                                     [[n for _, n in buffers[i]] for i in multi])
            codes.update(zip(multi, rcs))
        out = [self._get_result(store, key, sum(n for _, n in segs), codes[i])
               for i, (key, segs) in enumerate(zip(keys, buffers))]
        with self._lock:
            self._stats["gets"] += len(out)
            self._stats["hits"] += sum(r.ok for r in out)
            self._stats["misses"] += sum(not r.ok for r in out)
        return out

    @staticmethod
    def _get_result(store, key: str, want: int, code: int) -> ItemResult:
        if code == want:  # gets return the number of bytes read
            return ItemResult(key, want)
        if code == OBJECT_NOT_FOUND:
            return ItemResult(key, 0, KeyNotFound(f"key {key!r} not found"))
        # A wrong-sized buffer shows up as a short read, INVALID_PARAMS or TRANSFER_FAIL: ask the size.
        size = code if code > 0 else store.get_size(key)
        if size == OBJECT_NOT_FOUND:  # evicted or removed between the get and the size query
            return ItemResult(key, 0, KeyNotFound(f"key {key!r} not found"))
        if size >= 0 and size != want:
            return ItemResult(key, size, SizeMismatch(f"key {key!r}: stored {size} B, buffers hold {want} B"))
        return ItemResult(key, 0, _error("get", key, code))

    def exists(self, keys: list[str]) -> list[bool]:
        check_batch("exists", keys)
        codes = self._live().batch_is_exist(keys)
        bad = [(k, c) for k, c in zip(keys, codes) if c not in (0, 1)]
        if bad:
            raise StoreError(f"exists {bad[0][0]!r}: mooncake error code {bad[0][1]} ({len(bad)} key(s) failed)")
        return [c == 1 for c in codes]

    def remove(self, keys: list[str]) -> list[ItemResult]:
        check_batch("remove", keys)
        codes = self._live().batch_remove(keys, self.force_remove)
        return [ItemResult(k, 0, None if c == 0 else _error("remove", k, c)) for k, c in zip(keys, codes)]

    def clear(self) -> None:
        """Remove every value in the pool (all clients' keys; forced). For tests and resets."""
        rc = self._live().remove_all(True)
        if rc < 0:
            raise StoreError(f"remove_all failed with code {rc}")

    def stats(self) -> dict[str, int]:
        """Client-side counters plus ``capacity_bytes`` (this client's segment). Evictions happen
        in the master: see its ``/metrics`` endpoint."""
        with self._lock:
            return {**self._stats, "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        """Release every registered buffer and leave the cluster (takes ~1-2 s). Idempotent."""
        if self._store is None:
            return
        store, self._store = self._store, None
        with self._lock:
            failed = [p for p, _ in self._regs.items() if store.unregister_buffer(p) != 0]
            self._regs = Registrations()
        rc = store.close()
        if failed or rc != 0:
            raise StoreError(f"close: {len(failed)} buffer(s) failed to unregister, close code {rc}")

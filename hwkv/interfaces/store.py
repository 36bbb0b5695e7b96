"""Store interface: the global KV pool (batched, zero-copy into registered buffers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from hwkv.interfaces.transfer import ADDRESS_RANGE, check_range

Buffers = list[tuple[int, int]]  # (pointer, nbytes) segments making up one value


class StoreError(RuntimeError):
    """Base of per-item and whole-call store failures."""


class KeyNotFound(StoreError):
    pass


class StoreFull(StoreError):
    pass


class SizeMismatch(StoreError):
    pass


class StoreUnavailable(StoreError):
    """The store's service (e.g. the Mooncake master) cannot be reached: a whole-call failure."""


class StoreTimeout(StoreError):
    """A call did not finish within the store's timeout: a whole-call failure."""


@dataclass(frozen=True)
class ItemResult:
    """Outcome of one key of a batched call: ``error`` is ``None`` on success."""

    key: str
    nbytes: int = 0
    error: StoreError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Store(ABC):
    """A key → bytes store.

    Contract:
    * Arguments: ``keys`` is a list (or tuple) of non-empty str — a bare str is refused, never
      split into characters (one key is ``["key"]``); ``buffers`` holds one non-empty list of
      ``(ptr, nbytes)`` segments per key, ints (bools are not) with ``0 < ptr``, ``0 < nbytes``,
      ``ptr + nbytes <= 2**56`` (the user address space of 64-bit Linux). Anything else raises
      ``ValueError`` naming the argument, the item index and what is allowed, before any memory is
      touched (:func:`check_batch`). ``register_buffer``/``unregister_buffer`` check their range
      the same way.
    * ``put(keys, buffers)`` stores the concatenation of each key's segments; an existing key is
      overwritten. Per-item failures (e.g. :class:`StoreFull`) come back in the result list.
    * ``get(keys, buffers)`` copies each value into the key's segments, whose total size must equal
      the stored size (:class:`SizeMismatch` otherwise); a missing key gives :class:`KeyNotFound`.
    * ``exists`` returns one bool per key; ``remove`` returns one result per key (missing keys give
      :class:`KeyNotFound`).
    * Capacity-bounded stores evict least-recently used values (get and put count as use).
    * Whole-call failures raise :class:`StoreError`: :class:`StoreUnavailable` (service
      unreachable), :class:`StoreTimeout` (no answer within the store's timeout; networked stores
      bound every call, see their ``timeout_s``), plain :class:`StoreError` for a closed store.
    * ``close()`` is idempotent, releases every registration and returns promptly even when the
      service is gone.
    """

    owns_host_memory = False  # True: put/get reach only memory from host_buffer() (then register it)

    @abstractmethod
    def put(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]: ...

    @abstractmethod
    def get(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]: ...

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def remove(self, keys: list[str]) -> list[ItemResult]: ...

    def host_buffer(self, nbytes: int) -> int:
        """Where ``owns_host_memory``: the address of ``nbytes`` of host memory the store can put
        from and get into (e.g. shared memory a local holder copies through), valid until
        ``close``. Other stores have none."""
        raise NotImplementedError(f"{type(self).__name__} moves values from any registered memory (no host_buffer)")

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Register memory used as put/get buffers (only checked, for stores that need none)."""
        check_range("register_buffer", ptr, nbytes)

    def unregister_buffer(self, ptr: int) -> None:
        """Undo :meth:`register_buffer`."""
        check_range("unregister_buffer", ptr, 1)

    @abstractmethod
    def close(self) -> None: ...


def check_batch(op: str, keys: list[str], buffers: list[Buffers] | None = None) -> None:
    """``ValueError`` for a malformed batch, naming ``op``, the argument and the item index: keys
    not a list/tuple of non-empty str (a bare str included), a buffer list per key missing, a
    segment that is not an ``(ptr, nbytes)`` pair of ints inside the address space."""
    if not isinstance(keys, (list, tuple)):
        one = f" (one key is [{keys!r}])" if isinstance(keys, (str, bytes)) else ""
        raise ValueError(f"{op}: keys must be a list of str, got a {type(keys).__name__}{one}")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise ValueError(f"{op}: key {k!r} at keys[{i}] is invalid (need a non-empty str)")
    if buffers is None:
        return
    if not isinstance(buffers, (list, tuple)):
        raise ValueError(f"{op}: buffers must be a list with one list of (ptr, nbytes) per key, "
                         f"got a {type(buffers).__name__}")
    if len(keys) != len(buffers):
        raise ValueError(f"{op}: {len(keys)} keys but {len(buffers)} buffer lists (need one per key)")
    for i, (k, segs) in enumerate(zip(keys, buffers)):
        if not isinstance(segs, (list, tuple)):
            raise ValueError(f"{op}: buffers[{i}] (key {k!r}) is a {type(segs).__name__}, "
                             "not a list of (ptr, nbytes) segments")
        if not segs:
            raise ValueError(f"{op}: key {k!r} has no segments at buffers[{i}] (need at least one (ptr, nbytes))")
        for j, seg in enumerate(segs):
            if not isinstance(seg, (list, tuple)) or len(seg) != 2:
                raise ValueError(f"{op}: segment {seg!r} at buffers[{i}][{j}] (key {k!r}) is not a "
                                 f"(ptr, nbytes) pair (allowed: {ADDRESS_RANGE})")
            check_range(f"{op}: segment at buffers[{i}][{j}] (key {k!r})", seg[0], seg[1])

"""Store interface: the global KV pool (batched, zero-copy into registered buffers)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

Buffers = list[tuple[int, int]]  # (pointer, nbytes) segments making up one value


class StoreError(RuntimeError):
    """Base of per-item and whole-call store failures."""


class KeyNotFound(StoreError):
    pass


class StoreFull(StoreError):
    pass


class SizeMismatch(StoreError):
    pass


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
    * ``put(keys, buffers)`` stores the concatenation of each key's segments; an existing key is
      overwritten. Per-item failures (e.g. :class:`StoreFull`) come back in the result list.
    * ``get(keys, buffers)`` copies each value into the key's segments, whose total size must equal
      the stored size (:class:`SizeMismatch` otherwise); a missing key gives :class:`KeyNotFound`.
    * ``exists`` returns one bool per key; ``remove`` returns one result per key (missing keys give
      :class:`KeyNotFound`).
    * Capacity-bounded stores evict least-recently used values (get and put count as use).
    * Whole-call failures (connection lost, closed store) raise :class:`StoreError`.
    """

    @abstractmethod
    def put(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]: ...

    @abstractmethod
    def get(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]: ...

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    @abstractmethod
    def remove(self, keys: list[str]) -> list[ItemResult]: ...

    def register_buffer(self, ptr: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Register memory used as put/get buffers (no-op for stores that need none)."""

    def unregister_buffer(self, ptr: int) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`register_buffer`."""

    @abstractmethod
    def close(self) -> None: ...

"""The pool connector's store: which Store to use, and a handle that survives the store going away.

* ``{"store": "embedded"}`` — an in-process :class:`~hwkv.stores.embedded.EmbeddedStore` from a named
  registry (``store_name``, default ``"default"``), so several engines in one process share one pool;
  the first user's ``capacity_bytes`` sizes it.
* ``{"store": "mooncake", "master": "host:port", ...}`` — a Mooncake client
  (:class:`~hwkv.stores.mooncake.MooncakeStore`) owned by this connector.
* a :class:`~hwkv.interfaces.store.Store` instance — used as given, never closed here.

:class:`StoreHandle` bounds the damage of a store that fails: a whole-call :class:`StoreError`
marks it down for ``retry_s`` seconds (every call meanwhile fails at once with :class:`PoolDown`);
an owned client is then closed and rebuilt on the next call after that (its buffers registered
again), so the engine resumes using the pool when the master returns.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hwkv.interfaces.store import Store, StoreError

log = logging.getLogger("hwkv.pool")

_EMBEDDED: dict[str, Store] = {}
_EMBEDDED_LOCK = threading.Lock()


class PoolDown(StoreError):
    """The store failed recently (or cannot be reached); calls fail fast until ``retry_s`` passed."""


def embedded_store(name: str = "default", capacity_bytes: int = 1 << 30) -> Store:
    """The process-wide embedded store called ``name`` (created on first use)."""
    from hwkv.stores.embedded import EmbeddedStore

    with _EMBEDDED_LOCK:
        st = _EMBEDDED.get(name)
        if st is None or getattr(st, "_closed", False):
            st = _EMBEDDED[name] = EmbeddedStore(capacity_bytes)
        return st


def drop_embedded(name: str = "default") -> None:
    """Close and forget the embedded store ``name`` (tests; a later user gets a fresh one)."""
    with _EMBEDDED_LOCK:
        st = _EMBEDDED.pop(name, None)
    if st is not None:
        st.close()


MOONCAKE_KEYS = ("master", "metadata_server", "protocol", "host", "global_segment_size", "local_buffer_size",
                 "device_name", "timeout_s", "connect_timeout_s", "replicas", "holder", "shm_bytes")


def owns_memory(store: Any, options: dict[str, Any]) -> bool:
    """The configured store moves values only through its own host memory (holder mode)."""
    if isinstance(store, Store):
        return bool(store.owns_host_memory)
    return store == "mooncake" and options.get("holder") is not None


def store_factory(store: Any, options: dict[str, Any]) -> tuple[Callable[[], Store], bool]:
    """``(factory, owned)`` for the ``store`` config; ``ValueError`` for bad input, before connecting."""
    if isinstance(store, Store):
        if options:
            raise ValueError(f"pool: {', '.join(sorted(options))} apply to store='embedded'/'mooncake', "
                             "not to a Store instance (configure the instance itself)")
        return (lambda: store), False
    if store == "embedded":
        bad = sorted(set(options) - {"store_name", "capacity_bytes"})
        if bad:
            raise ValueError(f"pool: {', '.join(bad)} do not apply to store='embedded' "
                             "(allowed: store_name, capacity_bytes)")
        name, cap = options.get("store_name", "default"), options.get("capacity_bytes", 1 << 30)
        if not isinstance(name, str) or not name:
            raise ValueError(f"pool: store_name={name!r} is invalid (need a non-empty str)")
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 1:
            raise ValueError(f"pool: capacity_bytes={cap!r} is invalid (need an int >= 1)")
        return (lambda: embedded_store(name, cap)), False
    if store == "mooncake":
        bad = sorted(set(options) - set(MOONCAKE_KEYS))
        if bad:
            raise ValueError(f"pool: {', '.join(bad)} do not apply to store='mooncake' "
                             f"(allowed: {', '.join(MOONCAKE_KEYS)})")
        if not options.get("master"):
            raise ValueError("pool: store='mooncake' needs master='host:port' (mooncake_master's RPC address; "
                             "`hwkv pool master` starts one)")
        from hwkv.stores.mooncake import MooncakeStore

        accepted = inspect.signature(MooncakeStore).parameters
        kwargs = {k: v for k, v in options.items() if k in accepted}
        return (lambda: MooncakeStore(**kwargs)), True
    raise ValueError(f"pool: store={store!r} is invalid (allowed: 'embedded', 'mooncake' or a Store instance)")


class StoreHandle:
    """Thread-safe access to the pool's store with fail-fast while it is down (module docstring)."""

    def __init__(self, factory: Callable[[], Store], owned: bool, retry_s: float, owns_memory: bool = False):
        self._factory, self._owned, self.retry_s = factory, owned, retry_s
        self.owns_memory = owns_memory  # the store will be a holder-mode client: it must connect at start
        self._store: Store | None = None
        self._buffers: list[tuple[int, int]] = []
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.last_error = ""
        self._sticky = False  # the store's memory is in use: keep the client across failures
        self.connects = 0
        self.failures = 0

    @property
    def up(self) -> bool:
        return self._store is not None and time.monotonic() >= self._down_until

    def host_memory(self) -> Callable[[int], int] | None:
        """The store's own host memory allocator where it moves values only through that memory
        (``Store.owns_host_memory``: a holder-mode Mooncake client), else ``None``. Connects now:
        such a store must be reachable at start (``StoreError`` otherwise), and it is never rebuilt
        afterwards (the memory is the client's) — a failure only marks it down for ``retry_s``."""
        store = self._get(connect=True, raise_down=self.owns_memory)
        if store is None or not getattr(store, "owns_host_memory", False):
            return None
        self._sticky = True
        return store.host_buffer

    def register(self, buffers: list[tuple[int, int]]) -> None:
        """Buffers to register with every client this handle connects (now, if connected)."""
        self._buffers = list(buffers)
        with self._lock:
            live = self._store
        if live is not None:  # connected before (host_memory): register with that client now
            for ptr, n in self._buffers:
                live.register_buffer(ptr, n)
            return
        self._get(connect=True, raise_down=False)

    def _get(self, connect: bool = True, raise_down: bool = True) -> Store | None:
        with self._lock:
            if time.monotonic() < self._down_until:
                if raise_down:
                    raise PoolDown(f"pool store down ({self.last_error}); retrying in "
                                   f"{self._down_until - time.monotonic():.1f} s")
                return None
            if self._store is None and connect:
                try:
                    st = self._factory()
                    for ptr, n in self._buffers:
                        st.register_buffer(ptr, n)
                except (StoreError, OSError) as e:
                    self._mark_down(None, e)
                    if raise_down:
                        raise PoolDown(self.last_error) from e
                    return None
                self._store, self.connects = st, self.connects + 1
            return self._store

    def _mark_down(self, store: Store | None, e: BaseException) -> None:
        """Under the lock."""
        self.failures += 1
        self.last_error = f"{type(e).__name__}: {e}"[:300]
        self._down_until = time.monotonic() + self.retry_s
        log.warning("hwkv pool: store unavailable (%s); recompute until it answers (retry in %.1f s)",
                    self.last_error, self.retry_s)
        if store is not None and store is self._store and self._owned and not self._sticky:
            self._store = None
            threading.Thread(target=_close_quietly, args=(store,), daemon=True, name="hwkv-pool-close").start()

    def call(self, op: str, *args: Any) -> Any:
        """``store.<op>(*args)``; a whole-call :class:`StoreError` marks the store down and is raised."""
        store = self._get()
        try:
            return getattr(store, op)(*args)
        except StoreError as e:
            with self._lock:
                if store is self._store:
                    self._mark_down(store, e)
            raise

    def stats(self) -> dict[str, Any]:
        store = self._store
        out: dict[str, Any] = {"store_up": self.up, "store_connects": self.connects,
                               "store_failures": self.failures, "store_last_error": self.last_error}
        get = getattr(store, "stats", None)
        if callable(get):
            with contextlib.suppress(Exception):  # a store's own counters are informational only
                out["store"] = get()
        return out

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            self._down_until = float("inf")
        if store is None:
            return
        for ptr, _ in self._buffers:
            with contextlib.suppress(StoreError, ValueError):
                store.unregister_buffer(ptr)
        if self._owned:
            _close_quietly(store)


def _close_quietly(store: Store) -> None:
    try:
        store.close()
    except Exception as e:  # closing a client of a dead master: nothing left to do
        log.debug("hwkv pool: closing the store failed: %s", e)

"""MooncakeStore: the Store contract over ``mooncake.store.MooncakeDistributedStore``.

A client of a Mooncake cluster: it contributes ``global_segment_size`` bytes of this host's memory
to the pool, and puts/gets values that may live on any client's segment. A running
``mooncake_master`` is required (see ``docs/stores-and-transfer.md`` and
:func:`hwkv.stores.mooncake_service.mooncake_master`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from hwkv.interfaces.store import (
    Buffers,
    ItemResult,
    KeyNotFound,
    SizeMismatch,
    Store,
    StoreError,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
    check_batch,
)
from hwkv.stores.mooncake_faults import (
    LOG_HINT,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    RPC_TIMEOUT,
    call_error,
    code_name,
    item_error,
    master_error,
    probe_master,
    reaper,
)
from hwkv.transfer.bounded import BoundedCalls, CallTimedOut
from hwkv.transfer.mooncake import PROTOCOLS, Registrations, apply_log_level, load_mooncake

MIN_SEGMENT = 16 << 20  # the wheel refuses smaller global segments ("Total size must be at least 16777216")
_setup_env = threading.Lock()  # the RPC deadlines reach the client through the environment, read in setup()
log = logging.getLogger(__name__)


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
    * ``replicas`` copies of each value go to different segments (holders) where there are that
      many (fewer otherwise: the put still succeeds). A value outlives ``replicas - 1`` holders'
      exits — once the master drops a dead holder (its ``client_ttl``, 10 s by default); until
      then a get that picks the dead copy fails (the pool connector recomputes).
    * ``remove`` is forced by default (``force_remove``): a value being read (leased) is removed
      anyway; with ``force_remove=False`` it fails with a :class:`StoreError` naming the lease.

    * Holder mode (``holder="host:port"``, a ``mooncake_client`` on this host — the holder
      ``hwkv pool master`` starts): the client is Mooncake's *dummy client*. It holds no segment
      and no transfer engine; the holder moves every value between the pool and ``shm_bytes`` of
      shared memory this client maps (a local memcpy when the value lives in that holder, its
      transport otherwise). Only that memory can be put from or got into: take it with
      :meth:`host_buffer` and register it (``ValueError`` for other memory). ``owns_host_memory``
      says so to callers such as the pool connector. tcp over loopback moves ~1 GB/s; this moves
      what a memcpy does.

    Faults (see *Failure behaviour* in ``docs/stores-and-transfer.md``): the constructor probes
    the master (``connect_timeout_s``) before ``setup`` — which holds the GIL and would freeze
    every thread on a hung master. Every later call returns or raises within ``timeout_s``: it
    runs on a worker thread (the wheel releases the GIL there) and the client's RPC deadline is
    half of it, so an unreachable master gives :class:`StoreUnavailable` and a hung one
    :class:`StoreTimeout`, both naming the master. A timed-out call may still finish in the
    background; :meth:`unregister_buffer` and :meth:`close` wait for it (within their bound).
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
        timeout_s: float = 5.0,
        replicas: int = 1,
        holder: str | None = None,
        shm_bytes: int = 256 << 20,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not supported (allowed: {', '.join(PROTOCOLS)})")
        gss = global_segment_size
        if not isinstance(gss, int) or not (gss == 0 or gss >= MIN_SEGMENT):
            raise ValueError(f"global_segment_size={global_segment_size!r} is invalid "
                             f"(need 0 for a client that contributes no memory, or >= {MIN_SEGMENT})")
        if not isinstance(local_buffer_size, int) or local_buffer_size < 0:
            raise ValueError(f"local_buffer_size={local_buffer_size!r} is invalid (need an int >= 0)")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 8:
            raise ValueError(f"replicas={replicas!r} is invalid (need an int in 1..8: copies of each value, "
                             "each on a different segment)")
        for name, v in (("connect_timeout_s", connect_timeout_s), ("timeout_s", timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise ValueError(f"{name}={v!r} is invalid (need seconds in (0, 3600])")
        if holder is not None:
            hhost, _, hport = holder.rpartition(":") if isinstance(holder, str) else ("", "", "")
            if not hhost or not hport.isdigit():
                raise ValueError(f"holder={holder!r} is invalid (need 'host:port' of a mooncake_client on this host, "
                                 "`hwkv pool master`'s --holder-port)")
            if isinstance(shm_bytes, bool) or not isinstance(shm_bytes, int) or shm_bytes < MIN_SEGMENT:
                raise ValueError(f"shm_bytes={shm_bytes!r} is invalid (need an int >= {MIN_SEGMENT}: the shared "
                                 "memory this client moves values through)")
        mhost, _, mport = master.rpartition(":") if isinstance(master, str) else ("", "", "")
        if not mhost or not mport.isdigit():
            raise ValueError(f"master={master!r} is invalid (need 'host:port' of mooncake_master's RPC port)")
        store_mod = load_mooncake("store")
        self.master, self.timeout_s, self.connect_timeout_s = master, float(timeout_s), float(connect_timeout_s)
        # Probe first: setup() holds the GIL while it waits for the master, and retries a missing one.
        why = probe_master(master, connect_timeout_s)
        if why:
            raise master_error("create", master, why)
        self.capacity_bytes = 0 if holder else global_segment_size
        self.protocol, self.holder = protocol, holder
        self.owns_host_memory = holder is not None
        self._shm: list[tuple[int, int]] = []  # host_buffer() ranges (holder mode)
        self.force_remove = force_remove
        self._rpc_timeout_s = max(self.timeout_s / 2, 0.1)  # a put is two RPCs: both fit in timeout_s
        self._store = store_mod.MooncakeDistributedStore()
        self._replicate = store_mod.ReplicateConfig()
        self._replicate.replica_num = replicas
        self._store_mod, self._prefer_cfg = store_mod, {}  # put(prefer=): a config per preferred segment
        # setup() retries a failing client 20 times (meant for port clashes): 3 bound a master that
        # hangs between the probe and setup to 3 RPC deadlines, during which the GIL is held.
        env = {"MC_RPC_TIMEOUT_MS": str(int(self._rpc_timeout_s * 1000)),
               "MC_RPC_CONNECT_TIMEOUT_MS": str(int(self.connect_timeout_s * 1000)),
               "MC_STORE_CLIENT_SETUP_RETRIES": os.environ.get("MC_STORE_CLIENT_SETUP_RETRIES", "3")}
        if holder is not None:  # the holder answers like a master would (same RPC framework)
            why = probe_master(holder, connect_timeout_s)
            if why:
                raise StoreUnavailable(f"create: the pool holder (mooncake_client) at {holder} does not answer: {why}")
        with _setup_env:
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                if holder is not None:
                    rc = self._store.setup_dummy(shm_bytes, 0, holder)
                else:
                    rc = self._store.setup(host, metadata_server, global_segment_size, local_buffer_size, protocol,
                                           device_name, master)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        apply_log_level()  # the engine's config, loaded in setup, resets glog's level
        if rc != 0:
            with contextlib.suppress(Exception):
                self._store.close()
            why = probe_master(master, min(0.5, self.connect_timeout_s))  # it may have hung since
            if why:
                raise master_error("create", master, why)
            raise StoreError(f"MooncakeDistributedStore.setup(master={master!r}, metadata_server={metadata_server!r}, "
                             f"protocol={protocol!r}) failed ({code_name(rc)}; {LOG_HINT})")
        self._regs = Registrations()
        self._lock = threading.Lock()
        self._calls = BoundedCalls(f"mooncake-store-{master}", workers=16)  # concurrent gets (pool load_parallel)
        self._stats = dict.fromkeys(("puts", "put_full", "gets", "hits", "misses"), 0)

    def _live(self):
        if self._store is None:
            raise StoreError("store is closed")
        return self._store

    def _call(self, op: str, fn, *args):
        """``fn(*args)`` (a wheel call that releases the GIL) on a worker, bounded by ``timeout_s``."""
        try:
            return self._calls.run(fn, *args, timeout_s=self.timeout_s)
        except CallTimedOut as e:
            why = probe_master(self.master, min(0.2, self.connect_timeout_s))
            if why:
                raise master_error(op, self.master, why) from None
            state = "the master answers: a data transfer is stuck?" if e.started else \
                "queued behind stuck calls, never started"
            raise StoreTimeout(f"{op}: no answer within timeout_s={self.timeout_s:g} "
                               f"(mooncake master at {self.master}; {state})") from None

    def _codes(self, op: str, codes: list[int]) -> list[int]:
        err = call_error(op, self.master, codes, self._rpc_timeout_s)
        if err is not None:
            raise err
        return codes

    def _check_registered(self, op: str, buffers: list[Buffers]) -> None:
        with self._lock:
            for segs in buffers:
                for ptr, n in segs:
                    if not self._regs.covers(ptr, n):
                        raise ValueError(f"{op}: segment ({ptr:#x}, {n}) is not inside a registered buffer "
                                         "(call register_buffer first)")

    def host_buffer(self, nbytes: int) -> int:
        """Holder mode: ``nbytes`` of this client's shared memory (the holder copies values straight
        into and out of it); valid until :meth:`close`. Register it before use."""
        if not self.owns_host_memory:
            raise ValueError("host_buffer: only a holder-mode client (holder='host:port') has shared memory")
        store = self._live()
        ptr = int(self._call("host_buffer", store.alloc_from_mem_pool, int(nbytes)) or 0)
        if ptr <= 0:
            raise StoreError(f"host_buffer: {nbytes} B do not fit in this client's shared memory "
                             "(raise shm_bytes)")
        with self._lock:
            self._shm.append((ptr, int(nbytes)))
        return ptr

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        store = self._live()
        if self.owns_host_memory and not any(p <= ptr and ptr + nbytes <= p + n for p, n in self._shm):
            raise ValueError(f"register_buffer({ptr:#x}, {nbytes}): a holder-mode client moves values only "
                             "through its shared memory (allocate it with host_buffer())")
        with self._lock:
            self._regs.register(ptr, nbytes, lambda p, n: self._call("register_buffer", store.register_buffer, p, n),
                                StoreError, "register_buffer")
        if self.owns_host_memory:
            self._map_in_holder(store, ptr, nbytes)

    def _map_in_holder(self, store, ptr: int, nbytes: int) -> None:
        """Have the holder touch every page of ``ptr`` now: its first access of shared memory faults
        the pages into its mapping (3-6x the copy itself, measured), which would otherwise land on the
        first load. One put of the range under a scratch key, removed at once; best effort."""
        import uuid

        key = f"hwkv-map-{uuid.uuid4().hex}"
        step = 64 << 20
        try:
            for off in range(0, nbytes, step):
                n = min(step, nbytes - off)
                if self._call("register_buffer", store.put_from, key, ptr + off, n, self._replicate) == 0:
                    self._call("register_buffer", store.remove, key, True)
        except StoreError as e:
            log.debug("holder mode: mapping the shared memory ahead failed (%s); the first load pays for it", e)

    def unregister_buffer(self, ptr: int) -> None:
        """Unregister ``ptr`` once no call that may still use it runs (a call whose caller timed out
        can); :class:`StoreTimeout` if that takes longer than ``timeout_s`` (it stays registered)."""
        store = self._live()
        if not self._calls.wait_orphans(self.timeout_s):
            raise StoreTimeout(f"unregister_buffer({ptr:#x}): {self._calls.orphans()} timed-out call(s) still "
                               f"running after timeout_s={self.timeout_s:g} (mooncake master at {self.master}); "
                               "the buffer stays registered")
        with self._lock:
            self._regs.unregister(ptr, lambda p: self._call("unregister_buffer", store.unregister_buffer, p),
                                  StoreError, "unregister_buffer")

    def registered_buffers(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every registered buffer (empty after ``close``)."""
        return self._regs.items()

    def put(self, keys: list[str], buffers: list[Buffers], prefer: list[str | None] | None = None) -> list[ItemResult]:
        """The contract's put; ``prefer``: per key, the segment (``host:port`` of a holder, as
        :meth:`locate` names them) its first replica should go to, ``None`` = the master picks.
        Mooncake places it elsewhere when that segment has no room."""
        check_batch("put", keys, buffers)
        if prefer is not None and (not isinstance(prefer, (list, tuple)) or len(prefer) != len(keys)):
            raise ValueError(f"put: prefer must be a list with one segment (or None) per key ({len(keys)})")
        store = self._live()
        self._check_registered("put", buffers)
        groups: dict[str | None, list[int]] = {}
        for i in range(len(keys)):
            groups.setdefault(prefer[i] if prefer is not None else None, []).append(i)
        codes: dict[int, int] = {}
        for seg, idx in groups.items():  # one wheel call per preferred segment (a config each)
            single = [i for i in idx if len(buffers[i]) == 1]
            multi = [i for i in idx if len(buffers[i]) > 1]
            codes.update(zip(single + multi, self._call("put", self._put, store, keys, buffers, single, multi,
                                                        self._config(seg))))
        self._codes("put", list(codes.values()))
        out = []
        for i, (key, segs) in enumerate(zip(keys, buffers)):
            total = sum(n for _, n in segs)
            out.append(ItemResult(key, total, None if codes[i] == 0 else item_error("put", key, codes[i])))
        with self._lock:
            self._stats["puts"] += sum(r.ok for r in out)
            self._stats["put_full"] += sum(isinstance(r.error, StoreFull) for r in out)
        return out

    def _config(self, segment: str | None):
        if segment is None:
            return self._replicate
        cfg = self._prefer_cfg.get(segment)
        if cfg is None:
            cfg = self._store_mod.ReplicateConfig()
            cfg.replica_num = self._replicate.replica_num
            cfg.preferred_segment = segment
            self._prefer_cfg[segment] = cfg
        return cfg

    @staticmethod
    def _put(store, keys: list[str], buffers: list[Buffers], single: list[int], multi: list[int],
             config: object) -> list[int]:
        """On a worker: the wheel's codes for ``single`` then ``multi`` items."""
        rcs = []
        if single:
            rcs += store.batch_upsert_from([keys[i] for i in single], [buffers[i][0][0] for i in single],
                                           [buffers[i][0][1] for i in single], config)
        if multi:
            mkeys = [keys[i] for i in multi]
            removed = store.batch_remove(mkeys, True)  # missing keys answer OBJECT_NOT_FOUND: fine here
            lost = [c for c in removed if c in (RPC_FAIL, RPC_TIMEOUT)]
            if lost:  # no master: do not spend a second RPC deadline
                rcs += [lost[0]] * len(multi)
            else:
                rcs += store.batch_put_from_multi_buffers(mkeys, [[p for p, _ in buffers[i]] for i in multi],
                                                          [[n for _, n in buffers[i]] for i in multi], config)
        return rcs

    def get(self, keys: list[str], buffers: list[Buffers]) -> list[ItemResult]:
        check_batch("get", keys, buffers)
        store = self._live()
        self._check_registered("get", buffers)
        single = [i for i, segs in enumerate(buffers) if len(segs) == 1]
        multi = [i for i, segs in enumerate(buffers) if len(segs) > 1]
        codes = dict(zip(single + multi, self._call("get", self._get, store, keys, buffers, single, multi)))
        self._codes("get", list(codes.values()))
        out = [self._get_result(store, key, sum(n for _, n in segs), codes[i])
               for i, (key, segs) in enumerate(zip(keys, buffers))]
        with self._lock:
            self._stats["gets"] += len(out)
            self._stats["hits"] += sum(r.ok for r in out)
            self._stats["misses"] += sum(not r.ok for r in out)
        return out

    @staticmethod
    def _get(store, keys: list[str], buffers: list[Buffers], single: list[int], multi: list[int]) -> list[int]:
        rcs = []
        if single:
            rcs += store.batch_get_into([keys[i] for i in single], [buffers[i][0][0] for i in single],
                                        [buffers[i][0][1] for i in single])
        if multi:
            rcs += store.batch_get_into_multi_buffers([keys[i] for i in multi],
                                                      [[p for p, _ in buffers[i]] for i in multi],
                                                      [[n for _, n in buffers[i]] for i in multi])
        return rcs

    def _get_result(self, store, key: str, want: int, code: int) -> ItemResult:
        if code == want:  # gets return the number of bytes read
            return ItemResult(key, want)
        if code == OBJECT_NOT_FOUND:
            return ItemResult(key, 0, KeyNotFound(f"key {key!r} not found"))
        # A wrong-sized buffer shows up as a short read, INVALID_PARAMS or TRANSFER_FAIL: ask the size.
        size = code if code > 0 else self._codes("get", [self._call("get", store.get_size, key)])[0]
        if size == OBJECT_NOT_FOUND:  # evicted or removed between the get and the size query
            return ItemResult(key, 0, KeyNotFound(f"key {key!r} not found"))
        if size >= 0 and size != want:
            return ItemResult(key, size, SizeMismatch(f"key {key!r}: stored {size} B, buffers hold {want} B"))
        return ItemResult(key, 0, item_error("get", key, code))

    def exists(self, keys: list[str]) -> list[bool]:
        check_batch("exists", keys)
        store = self._live()
        codes = self._codes("exists", self._call("exists", store.batch_is_exist, keys))
        bad = [(k, c) for k, c in zip(keys, codes) if c not in (0, 1)]
        if bad:
            raise StoreError(f"exists {bad[0][0]!r}: mooncake error ({code_name(bad[0][1])}; "
                             f"{len(bad)} key(s) failed; {LOG_HINT})")
        return [c == 1 for c in codes]

    def locate(self, keys: list[str]) -> list[list[str]]:
        """Per key, the segments (``host:port`` of the holders or clients whose memory has a replica)
        it lives in; ``[]`` for a key not in the pool. One master RPC. Only a plain client can ask (a
        holder-mode client's answer is always empty): ``ValueError`` in holder mode."""
        check_batch("locate", keys)
        if self.owns_host_memory:
            raise ValueError("locate: a holder-mode client cannot ask where values live (use a plain client)")
        store = self._live()
        desc = self._call("locate", store.batch_get_replica_desc, keys)
        out = []
        for k in keys:
            where = []
            for r in desc.get(k) or []:
                with contextlib.suppress(Exception):  # a replica that is not in memory (disk): no segment
                    where.append(r.get_memory_descriptor().buffer_descriptor.transport_endpoint)
            out.append(where)
        return out

    def remove(self, keys: list[str]) -> list[ItemResult]:
        check_batch("remove", keys)
        store = self._live()
        codes = self._codes("remove", self._call("remove", store.batch_remove, keys, self.force_remove))
        return [ItemResult(k, 0, None if c == 0 else item_error("remove", k, c)) for k, c in zip(keys, codes)]

    def clear(self) -> None:
        """Remove every value in the pool (all clients' keys; forced). For tests and resets."""
        store = self._live()
        rc = self._call("clear", store.remove_all, True)
        if rc < 0:
            raise call_error("clear", self.master, [rc], self._rpc_timeout_s) or \
                StoreError(f"clear: remove_all failed ({code_name(rc)}; {LOG_HINT})")

    def stats(self) -> dict[str, int]:
        """Client-side counters plus ``capacity_bytes`` (this client's segment). Evictions happen
        in the master: see its ``/metrics`` endpoint."""
        with self._lock:
            return {**self._stats, "capacity_bytes": self.capacity_bytes}

    def close(self) -> None:
        """Release every registered buffer and leave the cluster. Idempotent; never waits on a
        master that is gone.

        With the master answering (probed, up to 1 s) and no timed-out call still running (waited
        for up to ``timeout_s``), this unregisters the buffers and closes the client (~1.5 s; the
        wheel holds the GIL meanwhile). Otherwise it returns at once and hands the client to
        :data:`~hwkv.stores.mooncake_faults.reaper`, which closes it once the master answers again
        (or the wheel's exit handler does, at exit), because the wheel's close would hold the GIL
        for 5-15 s retrying the master. Either way the store is closed and
        ``registered_buffers()`` is empty afterwards."""
        if self._store is None:
            return
        store, self._store = self._store, None
        with self._lock:
            regs, self._regs = self._regs.items(), Registrations()
            self._shm = []
        why = probe_master(self.master, min(1.0, self.connect_timeout_s))
        if why is None and not self._calls.wait_idle(self.timeout_s):
            why = f"{self._calls.in_flight()} timed-out call(s) still running"
        failed = []
        if why is None:
            try:
                failed = [p for p, _ in regs if self._call("close", store.unregister_buffer, p) != 0]
            except StoreError as e:
                why = str(e)
        self._calls.shutdown()
        if why is not None:
            reaper.add(store, self.master)
            log.warning("MooncakeStore.close: mooncake master at %s unreachable (%s); the client will be closed "
                        "once it answers again, or at exit", self.master, why)
            return
        rc = store.close()
        if failed or rc != 0:
            raise StoreError(f"close: {len(failed)} buffer(s) failed to unregister, close code {rc}")

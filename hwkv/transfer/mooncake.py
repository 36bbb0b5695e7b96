"""Transfer over the Mooncake TransferEngine (``mooncake.engine.TransferEngine``).

One engine per endpoint. Peers are named by their engine's segment name, which is what
:meth:`MooncakeTransfer.endpoint` returns:

* ``metadata_server="P2PHANDSHAKE"`` (default, no extra service): ``"<host>:<rpc_port>"``, the port
  the engine picked for its handshake listener.
* ``metadata_server="http://host:port/metadata"`` (``mooncake_master --enable_http_metadata_server``)
  or an etcd address: ``"<host>:<port>"`` with ``port`` given or a free one picked here, published
  in the metadata server.

Protocols: ``"tcp"`` (any host; the only one on the CPU wheel), ``"rdma"`` (CUDA, GPUDirect;
``device_name`` names the HCAs, e.g. ``"mlx5_0"``, empty = auto), ``"ascend"`` (NPU, HCCS).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from hwkv.interfaces.transfer import Transfer, TransferError, TransferTimeout
from hwkv.transfer.bounded import BoundedCalls, CallTimedOut
from hwkv.transfer.mooncake_wheel import (  # noqa: F401 - re-exported: the wheel's entry points live here
    INSTALL_HINT,
    LOG_HINT,
    NOT_INSTALLED,
    PROTOCOLS,
    Registrations,
    apply_log_level,
    check_peer,
    check_segments,
    engine_installed,
    free_port,
    load_mooncake,
    log_level,
    set_log_level,
)

log = logging.getLogger(__name__)
_engine_env = threading.Lock()


# One batch_transfer_sync_* call fails (code -1, nothing in Mooncake's log at the default level) for
# more than 2048 segments (wheel 0.3.13.post1, tcp; measured: 2048 pass, 2049 fail): a P/D transfer
# of a long prompt into scattered blocks is ~32 segments per block, so it splits into such batches.
MAX_BATCH_SEGMENTS = 2048
# Asynchronous segments in flight per endpoint (each is its own wheel batch). The tcp transport's
# lane queue rejects what does not fit ("TCP lane queue-full rejection", code -1 per segment: a
# submit of 3,000 small segments lost 600-800 of them on a 2-core VM); the rest wait in the batch's
# backlog and every poll() tops the window up.
MAX_IN_FLIGHT = 256


class MooncakeTransfer(Transfer):
    """A Mooncake TransferEngine endpoint.

    Local memory passed to ``write``/``read`` must lie inside a registered buffer; this is checked
    here for every protocol (the tcp transport would not notice, rdma would fail), so code tested on
    a CPU behaves the same on an RDMA NIC. Remote ranges are checked by the peer.

    Async: ``submit_*`` submits each segment as its own Mooncake batch
    (``batch_transfer_async_write/read``) and ``poll`` checks them with ``transfer_check_status``,
    which never blocks. (One multi-segment Mooncake batch cannot be polled: the wheel's
    ``get_batch_transfer_status`` spins until done and ``transfer_check_status`` looks at task 0
    only.) A failed batch is reported once all its segments have finished, so no segment is still
    in flight when ``poll`` raises. ``write``/``read`` use blocking ``batch_transfer_sync_*`` calls of at
    most ``MAX_BATCH_SEGMENTS`` segments each.

    Faults: ``write``/``read``/``submit_*``/``wait`` end within ``timeout_s`` plus 1 s per GiB
    moved (:class:`TransferTimeout`); the wheel would wait ~60 s for a peer that accepts the
    connection but never answers. Blocking wheel calls run on worker threads (they release the
    GIL), so other threads keep running. A timed-out call may still complete in the background:
    ``unregister`` and ``close`` wait for it, within ``timeout_s``; past that ``close`` leaves the
    engine to the process (never freed while a call may still use it).
    """

    def __init__(
        self,
        protocol: str = "tcp",
        host: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        device_name: str = "",
        port: int | None = None,
        timeout_s: float = 5.0,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not supported (allowed: {', '.join(PROTOCOLS)})")
        if not host or not isinstance(host, str):
            raise ValueError(f"host={host!r} is invalid (need an address such as '127.0.0.1')")
        if not metadata_server or not isinstance(metadata_server, str):
            raise ValueError(f"metadata_server={metadata_server!r} is invalid (use 'P2PHANDSHAKE' or an http:// URL)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid (need seconds in (0, 3600])")
        engine_mod = load_mooncake("engine")
        self.protocol, self.timeout_s, self.metadata_server = protocol, float(timeout_s), metadata_server
        self._check_metadata_server("create")
        with _engine_env:  # the engine reads its own transfer deadline (>= 5 s) when constructed
            saved = os.environ.get("MC_TRANSFER_TIMEOUT")
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, math.ceil(self.timeout_s)))
            try:
                self._engine = engine_mod.TransferEngine()
            finally:
                if saved is None:
                    os.environ.pop("MC_TRANSFER_TIMEOUT", None)
                else:
                    os.environ["MC_TRANSFER_TIMEOUT"] = saved
        p2p = metadata_server == "P2PHANDSHAKE"
        name = host if p2p else f"{host}:{port or free_port(host)}"
        rc = self._engine.initialize(name, metadata_server, protocol, device_name)
        apply_log_level()  # the engine's config, loaded in initialize, resets glog's level
        if rc != 0:
            raise TransferError(
                f"TransferEngine.initialize({name!r}, {metadata_server!r}, {protocol!r}) failed with code {rc} "
                f"({LOG_HINT})"
            )
        self._endpoint = f"{host}:{self._engine.get_rpc_port()}" if p2p else name
        self._regs = Registrations()
        self._batches: dict[int, tuple[str, str, list[int], list[int], int]] = {}  # id -> op, peer, pending, failed, B
        self._backlog: dict[int, tuple[Any, list[tuple[int, int, int]]]] = {}  # id -> submit fn, unsubmitted segments
        self._orphans: list[list[int]] = []  # segments of submits whose caller timed out
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._calls = BoundedCalls(f"mooncake-transfer-{self._endpoint}")

    def endpoint(self) -> str:
        return self._endpoint

    def _live(self):
        if self._engine is None:
            raise TransferError("transfer endpoint is closed")
        return self._engine

    def _deadline(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / (1 << 30)

    def _check_metadata_server(self, op: str) -> None:
        """Registration and initialization publish to an HTTP metadata server holding the GIL:
        make sure it answers first."""
        if not self.metadata_server.startswith(("http://", "https://")):
            return
        try:
            urllib.request.urlopen(f"{self.metadata_server}?key=hwkv-probe", timeout=self.timeout_s).close()
        except urllib.error.HTTPError:
            return  # it answered
        except (OSError, ValueError) as e:
            cls = TransferTimeout if isinstance(getattr(e, "reason", e), TimeoutError) else TransferError
            raise cls(f"{op}: metadata server {self.metadata_server} unreachable ({e})") from None

    def register(self, ptr: int, nbytes: int) -> None:
        engine = self._live()
        self._check_metadata_server("register")
        with self._lock:
            self._regs.register(ptr, nbytes, engine.register_memory, TransferError, "register_memory")

    def unregister(self, ptr: int) -> None:
        """Unregister ``ptr`` once no timed-out call that may still use it runs (waits up to
        ``timeout_s``; :class:`TransferTimeout` after that, and it stays registered)."""
        engine = self._live()
        if not self._quiesce(self.timeout_s):
            raise TransferTimeout(f"unregister_memory({ptr:#x}): timed-out transfers still running after "
                                  f"timeout_s={self.timeout_s:g}; the buffer stays registered")
        self._check_metadata_server("unregister")
        with self._lock:
            self._regs.unregister(ptr, engine.unregister_memory, TransferError, "unregister_memory")

    def registered_buffers(self) -> list[tuple[int, int]]:
        """``(ptr, nbytes)`` of every registered buffer (empty after ``close``)."""
        return self._regs.items()

    def _check(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        check_peer(op, peer)
        names = ("src_ptrs", "dst_ptrs") if op.endswith("write") else ("local_ptrs", "remote_ptrs")
        check_segments(op, local, lengths, remote, names)
        with self._lock:
            bad = [(p, n) for p, n in zip(local, lengths) if not self._regs.covers(p, n)]
        if bad:
            p, n = bad[0]
            raise TransferError(f"{op}: local range [{p:#x}, +{n}) is not inside a registered buffer "
                                f"({len(bad)} such segment(s)); call register() first")

    def _timeout(self, op: str, peer: str, lengths: list[int], deadline: float) -> TransferTimeout:
        return TransferTimeout(f"{op} with {peer!r} ({len(lengths)} segments, {sum(lengths)} B) did not finish "
                               f"within {deadline:g} s (timeout_s + 1 s/GiB; peer hung or unreachable?); it may "
                               "still complete in the background: close() waits for it")

    def write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        self._sync("write", peer, src_ptrs, dst_ptrs, lengths)

    def read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> None:
        self._sync("read", peer, local_ptrs, remote_ptrs, lengths)

    def _sync(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        engine = self._live()
        self._check(op, peer, local, remote, lengths)
        fn = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
        deadline = self._deadline(sum(lengths))  # one bound for the whole call, however it is split
        end = time.monotonic() + deadline
        for i in range(0, len(lengths), MAX_BATCH_SEGMENTS):
            part = slice(i, i + MAX_BATCH_SEGMENTS)
            left = end - time.monotonic()
            if left <= 0:
                raise self._timeout(op, peer, lengths, deadline)
            try:
                rc = self._calls.run(fn, peer, list(local[part]), list(remote[part]), list(lengths[part]),
                                     timeout_s=left)
            except CallTimedOut:
                raise self._timeout(op, peer, lengths, deadline) from None
            if rc != 0:
                n = len(lengths[part])
                raise TransferError(f"{op} with {peer!r} (segments {i}..{i + n - 1} of {len(lengths)}, "
                                    f"{sum(lengths[part])} B) failed with code {rc} ({LOG_HINT})")

    def submit_write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> int:
        return self._submit("write", peer, src_ptrs, dst_ptrs, lengths)

    def submit_read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> int:
        return self._submit("read", peer, local_ptrs, remote_ptrs, lengths)

    def _submit(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        engine = self._live()
        self._check(f"submit_{op}", peer, local, remote, lengths)
        fn = engine.batch_transfer_async_write if op == "write" else engine.batch_transfer_async_read
        parts: list[int] = []  # filled on the worker: a caller that timed out leaves them to close()
        deadline = self._deadline(sum(lengths))
        with self._lock:
            self._refresh()
            room = max(MAX_IN_FLIGHT - sum(len(e[2]) for e in self._batches.values()), 0)
            # earlier batches' backlogs go first (FIFO); one segment always goes now, through the bounded
            # worker call, so a peer that cannot be reached fails here, never inside poll()
            room = max(room if not self._backlog else 0, 1)
        now, later = slice(0, room), slice(room, None)
        try:
            ok = self._calls.run(_submit_parts, fn, peer, local[now], remote[now], lengths[now], parts,
                                 timeout_s=deadline)
        except CallTimedOut:
            with self._lock:
                self._orphans.append(parts)
            raise self._timeout(f"submit_{op}", peer, lengths, deadline) from None
        if not ok:
            self._drain(parts, self.timeout_s)
            raise TransferError(f"submit_{op} to {peer!r} failed (segment {len(parts)} of {len(lengths)} "
                                "could not be submitted: peer unreachable or unknown?)")
        with self._lock:
            batch = next(self._ids)
            self._batches[batch] = (op, peer, parts, [], sum(lengths))
            if len(lengths) > room:
                self._backlog[batch] = (fn, list(zip(local[later], remote[later], lengths[later])))
        return batch

    def _refresh(self) -> None:
        """(Under the lock.) Move finished segments of every batch out of its pending list, then
        submit backlogged segments, oldest batch first, while fewer than MAX_IN_FLIGHT are pending.
        Never blocks: the async wheel calls return at once (the peer's connection is up: the batch's
        first submit made it)."""
        engine = self._engine
        for _, _, pending, failed, _ in self._batches.values():
            still = []
            for b in pending:
                code = engine.transfer_check_status(b)  # 1 done, 0 pending, -1 failed, -2 timed out
                if code == 0:
                    still.append(b)
                elif code != 1:
                    failed.append(code)
            pending[:] = still
        room = MAX_IN_FLIGHT - sum(len(e[2]) for e in self._batches.values())
        for batch in sorted(self._backlog):
            fn, todo = self._backlog[batch]
            _, peer, pending, failed, _ = self._batches[batch]
            while todo and room > 0:
                p, r, n = todo.pop(0)
                bid = fn(peer, [p], [r], [n])
                if bid == 0:
                    failed.append(-1)
                else:
                    pending.append(bid)
                    room -= 1
            if todo:
                return
            del self._backlog[batch]

    def _drain(self, parts: list[int], timeout_s: float) -> bool:
        """Wait until the submitted segments ``parts`` finished (their memory may be reused or
        unregistered only then); whether they did within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while parts:
            parts[:] = [b for b in parts if self._engine.transfer_check_status(b) == 0]
            if parts:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.0002)
        return True

    def _quiesce(self, timeout_s: float) -> bool:
        """Wait for timed-out calls and their submitted segments; whether all finished in time."""
        deadline = time.monotonic() + timeout_s
        if not self._calls.wait_orphans(timeout_s):
            return False
        with self._lock:
            orphans = list(self._orphans)
        if all(self._drain(p, max(deadline - time.monotonic(), 0)) for p in orphans):
            with self._lock:
                self._orphans = [p for p in self._orphans if p]
            return True
        return False

    def wait(self, batch: int, timeout_s: float | None = None) -> None:
        """Poll ``batch`` until done; :class:`TransferTimeout` after ``timeout_s`` (default: the
        endpoint's ``timeout_s`` plus 1 s per GiB of the batch)."""
        if timeout_s is None:
            with self._lock:
                entry = self._batches.get(batch) if not isinstance(batch, bool) else None
            timeout_s = self._deadline(entry[4] if entry else 0)
        super().wait(batch, timeout_s)

    def poll(self, batch: int) -> bool:
        self._live()
        with self._lock:
            if isinstance(batch, bool) or batch not in self._batches:
                raise ValueError(f"batch={batch!r} is not a pending transfer batch of this endpoint")
            op, peer, pending, failed, _ = self._batches[batch]
            if self._backlog or pending:
                self._refresh()
            if pending or batch in self._backlog:
                return False
            del self._batches[batch]
        if failed:
            raise TransferError(f"{op} batch {batch} with {peer!r}: {len(failed)} segment(s) failed "
                                f"(codes {sorted(set(failed))}; -1 failed, -2 timed out; {LOG_HINT})")
        return True

    def close(self) -> None:
        """Wait for in-flight batches and timed-out calls (up to ``timeout_s`` in all), release
        every registration, shut the engine down (~1 s). Idempotent. If something is still in
        flight after ``timeout_s``, the engine is left alive for the rest of the process (a
        transfer may still use it and the registered memory) and close returns."""
        if self._engine is None:
            return
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            batches = [entry[2] for entry in self._batches.values()]
            self._batches.clear()
            self._backlog.clear()  # never submitted: nothing of them is in flight
        done = self._calls.wait_idle(self.timeout_s) and self._quiesce(max(deadline - time.monotonic(), 0)) and all(
            self._drain(parts, max(deadline - time.monotonic(), 0)) for parts in batches)
        with self._lock:
            engine, self._engine = self._engine, None
            regs, self._regs = self._regs.items(), Registrations()
        self._calls.shutdown()
        if not done:
            _leak(engine)
            log.warning("MooncakeTransfer.close(%s): transfers still running after timeout_s=%g; the engine is "
                        "left alive until the process exits", self._endpoint, self.timeout_s)
            return
        errors = [p for p, _ in regs if engine.unregister_memory(p) != 0]
        del engine  # the wheel tears the engine down when the object is freed
        if errors:
            raise TransferError(f"unregister_memory failed on close for {len(errors)} buffer(s)")

    def __enter__(self) -> MooncakeTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _submit_parts(fn, peer: str, local: list[int], remote: list[int], lengths: list[int], parts: list[int]) -> bool:
    """On a worker: submit each segment as its own batch, appending its id to ``parts``; whether
    all were submitted (0 is the wheel's failure sentinel: peer unreachable, bad arguments)."""
    for p, r, n in zip(local, remote, lengths):
        bid = fn(peer, [p], [r], [n])
        if bid == 0:
            return False
        parts.append(bid)
    return True


def _leak(obj: object) -> None:
    """Keep ``obj`` alive until the process exits, interpreter teardown included: a worker may
    still be inside one of its calls."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

"""Mooncake store faults: error codes as named exceptions, and a liveness probe of the master.

Codes are Mooncake's ``ErrorCode`` (``mooncake-store/include/types.h``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from hwkv.interfaces.store import KeyNotFound, StoreError, StoreFull, StoreTimeout, StoreUnavailable
from hwkv.transfer.mooncake_wheel import LOG_HINT

CODE_NAMES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND", -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE", -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE", -701: "INVALID_READ", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE", -714: "OBJECT_REPLICA_BUSY", -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH", -900: "RPC_FAIL", -901: "RPC_TIMEOUT", -1700: "TENANT_QUOTA_EXCEEDED",
}
NO_SPACE = (-10, -200, -1700)
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE = -704, -706
RPC_FAIL, RPC_TIMEOUT = -900, -901


def code_name(code: int) -> str:
    return f"{CODE_NAMES.get(code, 'unknown error')}, code {code}"


def item_error(op: str, key: str, code: int) -> StoreError:
    """The per-item error of a Mooncake code that concerns one key."""
    if code in NO_SPACE:
        return StoreFull(f"{op} {key!r}: no space in the pool ({code_name(code)})")
    if code == OBJECT_NOT_FOUND:
        return KeyNotFound(f"key {key!r} not found")
    if code == OBJECT_HAS_LEASE:
        return StoreError(f"{op} {key!r}: the value is leased to a reader ({code_name(code)}); "
                          "retry after the lease ttl")
    return StoreError(f"{op} {key!r}: mooncake error ({code_name(code)}; {LOG_HINT})")


def call_error(op: str, master: str, codes: list[int], rpc_timeout_s: float) -> StoreError | None:
    """The whole-call error when any item failed for want of the master (``None`` otherwise):
    its RPCs all go to the same master, so one such code means none of the call can be trusted."""
    if RPC_TIMEOUT in codes:
        return StoreTimeout(f"{op}: mooncake master at {master} did not answer within {rpc_timeout_s:g} s "
                            f"(hung or overloaded? {code_name(RPC_TIMEOUT)})")
    if RPC_FAIL in codes:
        return StoreUnavailable(f"{op}: mooncake master at {master} unreachable ({code_name(RPC_FAIL)}; "
                                "is it running?)")
    return None


# A coro_rpc request header (magic 21) for function id 0, which no server registers: a live master
# answers at once with a coro_rpc error response; a stopped one accepts the TCP connection (the
# kernel does) and says nothing.
PROBE = b"\x15" + bytes(31)


def probe_master(master: str, timeout_s: float) -> str | None:
    """``None`` when ``master`` (``host:port``) answers an RPC request within ``timeout_s``, else
    why not (starting with ``"no answer"`` when it accepted the connection but stayed silent).
    Plain sockets: other threads keep running while it waits."""
    host, _, port = master.rpartition(":")
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as s:
            s.sendall(PROBE)
            s.settimeout(max(deadline - time.monotonic(), 0.001))
            answer = s.recv(1)
    except TimeoutError:
        return f"no answer within {timeout_s:g} s (hung or stopped?)"
    except OSError as e:
        return f"{e.strerror or e} (is it running?)"
    if answer != PROBE[:1]:
        return "it closed the connection without an RPC answer (not a mooncake_master RPC port?)"
    return None


def master_error(op: str, master: str, why: str) -> StoreError:
    """:class:`StoreTimeout` for a master that accepts connections but does not answer (hung,
    stopped, overloaded), else :class:`StoreUnavailable` (not running, unreachable)."""
    cls = StoreTimeout if why.startswith("no answer") else StoreUnavailable
    return cls(f"{op}: mooncake master at {master} unreachable: {why}")


class Reaper:
    """Mooncake clients that ``close()`` left because their master was unreachable.

    The wheel's close holds the GIL while it retries the master (5-15 s of a frozen interpreter),
    so such a client is handed here instead: a daemon thread probes its master every
    ``interval_s`` and closes the client once the master answers again (quickly then). Clients
    still here at exit are torn down by the wheel's own exit handler (~7 s each, master gone)."""

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._clients: list[tuple[object, str]] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, client: object, master: str) -> None:
        with self._lock:
            self._clients.append((client, master))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mooncake-reaper", daemon=True)
                self._thread.start()

    def pending(self, master: str | None = None) -> int:
        """Clients not closed yet (of ``master`` only, when given)."""
        with self._lock:
            return sum(1 for _, m in self._clients if master is None or m == master)

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            with self._lock:
                clients = list(self._clients)
            for client, master in clients:
                if probe_master(master, self.interval_s) is None:
                    with contextlib.suppress(Exception):
                        client.close()
                    with self._lock:
                        self._clients.remove((client, master))
            with self._lock:
                if not self._clients:
                    self._thread = None
                    return


reaper = Reaper()

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

import bisect
import importlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from types import ModuleType

from hwkv.interfaces.transfer import Transfer, TransferError, check_range

PROTOCOLS = ("tcp", "rdma", "ascend", "nvlink", "efa", "hip", "cxl", "barex")
INSTALL_HINT = "pip install 'hwkv[mooncake]' (Debian/Ubuntu also need: apt-get install -y libibverbs1 libnuma1)"
NOT_INSTALLED = "mooncake-transfer-engine not installed: pip install 'hwkv[mooncake]'"


def engine_installed() -> bool:
    """Whether ``mooncake.engine`` can be imported — found without importing or executing anything,
    so backends can declare their transfer protocols cheaply."""
    import importlib.machinery
    import importlib.util

    try:
        pkg = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return False
    if pkg is None or not pkg.submodule_search_locations:
        return False
    return importlib.machinery.PathFinder.find_spec("engine", list(pkg.submodule_search_locations)) is not None


def load_mooncake(submodule: str) -> ModuleType:
    """Import ``mooncake.<submodule>`` or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(f"mooncake.{submodule}")
    except (ImportError, OSError) as e:  # OSError: a shared library of the wheel is missing
        raise ImportError(f"Mooncake is not usable here ({e}); install it with: {INSTALL_HINT}") from e


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Registrations:
    """Registered ``[ptr, ptr + nbytes)`` ranges; answers "does this range lie inside one?"."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._sizes: dict[int, int] = {}

    def add(self, ptr: int, nbytes: int) -> None:
        i = bisect.bisect_right(self._starts, ptr)
        overlaps_prev = i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > ptr
        overlaps_next = i < len(self._starts) and self._starts[i] < ptr + nbytes
        if overlaps_prev or overlaps_next:
            raise ValueError(f"buffer [{ptr:#x}, +{nbytes}) overlaps a registered buffer")
        self._starts.insert(i, ptr)
        self._sizes[ptr] = nbytes

    def pop(self, ptr: int) -> int:
        if ptr not in self._sizes:
            raise ValueError(f"ptr {ptr:#x} is not a registered buffer (register it first)")
        self._starts.remove(ptr)
        return self._sizes.pop(ptr)

    def covers(self, ptr: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, ptr) - 1
        return i >= 0 and ptr + nbytes <= self._starts[i] + self._sizes[self._starts[i]]

    def items(self) -> list[tuple[int, int]]:
        return [(p, self._sizes[p]) for p in self._starts]

    def register(self, ptr: int, nbytes: int, call: Callable[[int, int], int], error: type[Exception],
                 what: str) -> None:
        """Track ``[ptr, +nbytes)`` and register it through ``call`` (a Mooncake int return code);
        on failure nothing stays tracked and ``error`` is raised."""
        check_range(what, ptr, nbytes)
        self.add(ptr, nbytes)
        rc = call(ptr, nbytes)
        if rc != 0:
            self.pop(ptr)
            raise error(f"{what}({ptr:#x}, {nbytes}) failed with code {rc}")

    def unregister(self, ptr: int, call: Callable[[int], int], error: type[Exception], what: str) -> None:
        """Unregister through ``call``; the range stays tracked if that fails (it is still registered)."""
        check_range(what, ptr, 1)
        if ptr not in self._sizes:
            raise ValueError(f"ptr {ptr:#x} is not a registered buffer (register it first)")
        rc = call(ptr)
        if rc != 0:
            raise error(f"{what}({ptr:#x}) failed with code {rc}")
        self.pop(ptr)


def check_segments(op: str, ptrs: list[int], lengths: list[int], others: list[int] | None = None,
                   names: tuple[str, str] = ("local_ptrs", "remote_ptrs")) -> None:
    """``ValueError`` naming the argument and item index unless ``ptrs`` (and ``others``, the
    peer's pointers) and ``lengths`` are equally long, non-empty lists whose ranges lie in the
    address space (:func:`~hwkv.interfaces.transfer.check_range`)."""
    lists = {names[0]: ptrs, "lengths": lengths, **({} if others is None else {names[1]: others})}
    for name, v in lists.items():
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"{op}: {name} must be a list of ints, got a {type(v).__name__}")
    if len({len(v) for v in lists.values()}) != 1:
        sizes = ", ".join(f"{k}: {len(v)}" for k, v in lists.items())
        raise ValueError(f"{op}: pointer/length lists differ in length ({sizes})")
    if not ptrs:
        raise ValueError(f"{op}: no segments given (need at least one)")
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"{op}: length {n!r} at lengths[{i}] is invalid (need an int > 0)")
        check_range(f"{op}: {names[0]}[{i}]", ptrs[i], n)
        if others is not None:
            check_range(f"{op}: {names[1]}[{i}]", others[i], n)


def check_peer(op: str, peer: object) -> None:
    if not isinstance(peer, str) or not peer:
        raise ValueError(f"{op}: peer={peer!r} is invalid (need the peer's endpoint() string, e.g. '127.0.0.1:17001')")


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
    in flight when ``poll`` raises. ``write``/``read`` use one blocking ``batch_transfer_sync_*``.
    """

    def __init__(
        self,
        protocol: str = "tcp",
        host: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        device_name: str = "",
        port: int | None = None,
    ):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not supported (allowed: {', '.join(PROTOCOLS)})")
        if not host or not isinstance(host, str):
            raise ValueError(f"host={host!r} is invalid (need an address such as '127.0.0.1')")
        if not metadata_server:
            raise ValueError(f"metadata_server={metadata_server!r} is invalid (use 'P2PHANDSHAKE' or an http:// URL)")
        engine_mod = load_mooncake("engine")
        self.protocol = protocol
        self._engine = engine_mod.TransferEngine()
        p2p = metadata_server == "P2PHANDSHAKE"
        name = host if p2p else f"{host}:{port or free_port(host)}"
        rc = self._engine.initialize(name, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"TransferEngine.initialize({name!r}, {metadata_server!r}, {protocol!r}) failed with code {rc}"
            )
        self._endpoint = f"{host}:{self._engine.get_rpc_port()}" if p2p else name
        self._regs = Registrations()
        self._batches: dict[int, tuple[str, str, list[int], list[int]]] = {}  # id -> (op, peer, pending, failed)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def endpoint(self) -> str:
        return self._endpoint

    def _live(self):
        if self._engine is None:
            raise TransferError("transfer endpoint is closed")
        return self._engine

    def register(self, ptr: int, nbytes: int) -> None:
        engine = self._live()
        with self._lock:
            self._regs.register(ptr, nbytes, engine.register_memory, TransferError, "register_memory")

    def unregister(self, ptr: int) -> None:
        engine = self._live()
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

    def write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> None:
        self._sync("write", peer, src_ptrs, dst_ptrs, lengths)

    def read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> None:
        self._sync("read", peer, local_ptrs, remote_ptrs, lengths)

    def _sync(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        self._check(op, peer, local, remote, lengths)
        engine = self._live()
        fn = engine.batch_transfer_sync_write if op == "write" else engine.batch_transfer_sync_read
        rc = fn(peer, local, remote, lengths)
        if rc != 0:
            raise TransferError(f"{op} with {peer!r} ({len(lengths)} segments, {sum(lengths)} B) failed with code {rc}")

    def submit_write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int]) -> int:
        return self._submit("write", peer, src_ptrs, dst_ptrs, lengths)

    def submit_read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int]) -> int:
        return self._submit("read", peer, local_ptrs, remote_ptrs, lengths)

    def _submit(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        self._check(f"submit_{op}", peer, local, remote, lengths)
        engine = self._live()
        fn = engine.batch_transfer_async_write if op == "write" else engine.batch_transfer_async_read
        parts: list[int] = []
        for p, r, n in zip(local, remote, lengths):
            bid = fn(peer, [p], [r], [n])
            if bid == 0:  # the wheel's failure sentinel (peer unreachable, bad arguments)
                self._drain(parts)
                raise TransferError(f"submit_{op} to {peer!r} failed (segment {len(parts)} of {len(lengths)} "
                                    "could not be submitted: peer unreachable or unknown?)")
            parts.append(bid)
        with self._lock:
            batch = next(self._ids)
            self._batches[batch] = (op, peer, parts, [])
        return batch

    def _drain(self, parts: list[int]) -> None:
        # Segments already submitted must finish before their memory may be reused or unregistered.
        while parts:
            parts[:] = [b for b in parts if self._engine.transfer_check_status(b) == 0]
            if parts:
                time.sleep(0.0002)

    def poll(self, batch: int) -> bool:
        engine = self._live()
        with self._lock:
            if isinstance(batch, bool) or batch not in self._batches:
                raise ValueError(f"batch={batch!r} is not a pending transfer batch of this endpoint")
            op, peer, pending, failed = self._batches[batch]
            still = []
            for b in pending:
                code = engine.transfer_check_status(b)  # 1 done, 0 pending, -1 failed, -2 timed out
                if code == 0:
                    still.append(b)
                elif code != 1:
                    failed.append(code)
            pending[:] = still
            if pending:
                return False
            del self._batches[batch]
        if failed:
            raise TransferError(f"{op} batch {batch} with {peer!r}: {len(failed)} segment(s) failed "
                                f"(codes {sorted(set(failed))}; -1 failed, -2 timed out)")
        return True

    def close(self) -> None:
        """Wait for in-flight batches, release every registration, shut the engine down. Idempotent."""
        if self._engine is None:
            return
        with self._lock:
            for _, _, pending, _ in self._batches.values():
                self._drain(pending)
            self._batches.clear()
            errors = [p for p, _ in self._regs.items() if self._engine.unregister_memory(p) != 0]
            self._regs = Registrations()
            self._engine = None  # the wheel tears the engine down when the object is freed
        if errors:
            raise TransferError(f"unregister_memory failed on close for {len(errors)} buffer(s)")

    def __enter__(self) -> MooncakeTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Same-host direct transfer: peers on one host map each other's registered memory and copy into it
without a network stack (the shape of NIXL's UCX ``cuda_ipc``/``cma`` transports and of Mooncake's
intra-node NVLink transport).

:class:`DirectTransfer` is the :class:`~hwkv.interfaces.transfer.Transfer` contract on top of a
:class:`Mover`, the device-specific half:

* ``cma`` (:class:`HostMover`, here): host memory of another process through Linux cross-memory
  attach (``process_vm_readv``/``process_vm_writev``), ``memmove`` within one process. It needs
  ptrace permission over the peer (same user; no Yama restriction, no seccomp filter refusing the
  calls): where that is missing the handshake probe fails and callers fall back to ``tcp``.
* ``cuda_ipc`` (``hwkv_cuda.ipc.CudaIpcMover``): CUDA IPC memory handles, copy-engine copies over
  NVLink (or PCIe) between the GPUs of one host.

How peers find each other: every endpoint serves its registrations on a small ZMQ REP socket
(``endpoint()`` is its ``host:port``): base address, size and the mover's export handle of each
registered buffer, plus the host identity (boot id and pid namespace), the process id and a probe
word. A peer fetches that once (and again when a remote range is not in it, or a region was
revoked), attaches the regions it uses (opening IPC handles), checks it can reach the probe word,
then copies into / out of the attached addresses. Messages are msgspec, never pickle.

Lifetime: ``unregister`` and ``close`` wait (bounded) for the batches in flight; ``close`` stops
serving and detaches every peer region this endpoint opened. A peer whose process exited is
detected at submit (its pid is gone): its regions are detached and the call raises
:class:`~hwkv.interfaces.transfer.TransferError`; a peer that stops answering the describe call
fails it within ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from hwkv.interfaces.transfer import ADDRESS_LIMIT, Transfer, TransferError, TransferTimeout, check_range
from hwkv.transfer.mooncake_wheel import Registrations, check_peer, check_segments

log = logging.getLogger(__name__)

# protocols served by DirectTransfer (the backend's mover decides which one it has)
DIRECT_PROTOCOLS = ("cuda_ipc", "cma")


def host_identity() -> str:
    """Peers with equal identities share memory reachability: same kernel boot and pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{boot}/{ns}"


def merge_runs(local: list[int], remote: list[int], lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge neighbouring segments contiguous on both sides (vLLM's ``group_concurrent_contiguous``):
    one copy per run instead of one per segment. Order is kept."""
    lp, rp, ln = _merge(np.asarray(local, np.int64), np.asarray(remote, np.int64), np.asarray(lengths, np.int64))
    return lp.tolist(), rp.tolist(), ln.tolist()


def _merge(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    if len(lengths) < 2:
        return local, remote, lengths
    joins = (local[1:] == local[:-1] + lengths[:-1]) & (remote[1:] == remote[:-1] + lengths[:-1])
    if not joins.any():
        return local, remote, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return local[starts], remote[starts], np.add.reduceat(lengths, starts)


def _ints(v: object) -> bool:
    # ints, bools not (``type(x) is int``); the types collected in C: a 10k-segment KV load is checked
    # in well under a millisecond (a generator over the items took tens)
    return isinstance(v, (list, tuple)) and set(map(type, v)) <= {int}


class Mover(ABC):
    """The device-specific half of a direct transfer. ``submit`` never blocks on the copy itself."""

    protocol: str = ""
    # whether ``submit(..., after=event)`` orders the copies after a device event on the device itself
    # (the copy streams wait for it); otherwise the host waits for the event before submitting
    orders_after: bool = False

    def check_local(self, ptr: int, nbytes: int) -> None:  # noqa: B027 - optional hook
        """Raise ``TransferError`` if ``[ptr, +nbytes)`` cannot be registered (e.g. not device memory)."""

    @abstractmethod
    def export(self, ptr: int, nbytes: int) -> bytes:
        """What another process of this host needs to reach ``[ptr, +nbytes)``."""

    @abstractmethod
    def attach(self, pid: int, base: int, nbytes: int, handle: bytes) -> tuple[int, Any]:
        """Make a peer's region reachable here: ``(address of its base in this process, token)``.
        ``pid == os.getpid()``: the region is this process's own memory."""

    @abstractmethod
    def detach(self, token: Any) -> None: ...

    @abstractmethod
    def submit(self, op: str, pid: int, local: np.ndarray, target: np.ndarray, lengths: np.ndarray,
               after: Any = None) -> Any:
        """Start copies (``op`` "write": local -> target, "read": target -> local; int64 arrays of
        addresses and byte counts); a ticket. ``after`` (only where ``orders_after``): a device event
        the copies start after, without the host waiting for it."""

    @abstractmethod
    def done(self, ticket: Any) -> bool:
        """Whether the copies of ``ticket`` finished; raises on failure; never blocks."""

    def release(self, ticket: Any) -> None:  # noqa: B027 - optional hook
        """Free what ``ticket`` holds (called once it is done or abandoned)."""

    def probe_memory(self, nonce: int) -> tuple[int, Any]:
        """64 bytes of this mover's memory kind starting with ``nonce`` (little-endian u64):
        ``(address, owner)``; peers read it to check the path works."""
        buf = ctypes.create_string_buffer(struct.pack("<Q", nonce), 64)
        return ctypes.addressof(buf), buf

    def scratch(self) -> Any:
        """8 bytes of this mover's memory kind a probe read lands in: ``.address``, ``.value()``."""
        return _HostScratch()

    def close(self) -> None:
        return None


# ---- the describe exchange ------------------------------------------------------------------------
class Region(msgspec.Struct, array_like=True, frozen=True):
    base: int
    nbytes: int
    handle: bytes


class Describe(msgspec.Struct, tag=True):
    pass


class Description(msgspec.Struct, tag=True):
    protocol: str
    host_id: str
    pid: int
    regions: list[Region]
    probe: int  # address of 8 registered-by-nobody bytes holding ``nonce`` (inside probe_region)
    probe_region: Region
    nonce: int
    generation_file: str = ""  # 8 bytes (u64 LE): bumped on every unregister, CLOSED once closed
    generation: int = 0


CLOSED = (1 << 63) - 1
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Describe | Description)


class _Generation:
    """A u64 in a small shared file (``/dev/shm``): the exporter bumps it whenever a registration
    goes away, so importers notice revocation with one memory read per submit (no round trip)."""

    def __init__(self, path: str = "", create: bool = False):
        import mmap
        import tempfile

        if create:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            _reap(root)
            path = os.path.join(root, f"hwkv-direct-{os.getpid()}-{os.urandom(6).hex()}")
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, 8)
        else:
            fd = os.open(path, os.O_RDONLY)
        try:
            self.map = mmap.mmap(fd, 8, access=mmap.ACCESS_WRITE if create else mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.path, self.owner = path, create

    def get(self) -> int:
        return struct.unpack_from("<Q", self.map, 0)[0]

    def set(self, value: int) -> None:
        struct.pack_into("<Q", self.map, 0, value)

    def close(self) -> None:
        if self.owner:
            self.set(CLOSED)
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # importers keep their mapping and read CLOSED
        self.map.close()


def _reap(root: str) -> None:
    """Remove generation files of processes that died without closing (killed)."""
    try:
        names = [n for n in os.listdir(root) if n.startswith("hwkv-direct-")]
    except OSError:
        return
    for n in names:
        try:
            pid = int(n.split("-")[2])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(root, n))
        except (ValueError, IndexError, PermissionError):
            continue


@dataclass
class _Peer:
    desc: Description
    starts: list[int]
    mapped: dict[int, tuple[int, Any]] = field(default_factory=dict)  # region base -> (local base, token)
    probed: bool = False
    gen: _Generation | None = None


@dataclass
class _Batch:
    op: str
    peer: str
    ticket: Any
    nbytes: int
    locals_: list[tuple[int, int]]  # registered local buffers the batch touches (for unregister)


class DirectTransfer(Transfer):
    """A same-host direct endpoint over ``mover`` (see the module docstring).

    ``host`` is where the describe socket listens (peers must be on this host anyway)."""

    def __init__(self, mover: Mover, host: str = "127.0.0.1", timeout_s: float = 5.0):
        import zmq

        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 3600:
            raise ValueError(f"timeout_s={timeout_s!r} is invalid (need seconds in (0, 3600])")
        if not host or not isinstance(host, str):
            raise ValueError(f"host={host!r} is invalid (need an address such as '127.0.0.1')")
        self.mover, self.protocol, self.timeout_s = mover, mover.protocol, float(timeout_s)
        self.host_id, self.pid = host_identity(), os.getpid()
        self._regs = Registrations()
        self._exports: dict[int, Region] = {}
        self._peers: dict[str, _Peer] = {}
        self._batches: dict[int, _Batch] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False
        # the probe word: a peer reads it through the mover before trusting the path
        self._nonce = int.from_bytes(os.urandom(8), "little") | 1
        self._probe, self._probe_owner = mover.probe_memory(self._nonce)
        self._gen = _Generation(create=True)
        probe = self._probe
        self._probe_region = Region(probe, 64, mover.export(probe, 64))
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self._endpoint = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"direct-transfer-{port}", daemon=True)
        self._thread.start()

    # ---- serving ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            try:
                msg = _dec.decode(self._sock.recv())
            except Exception as e:  # answer garbage with an empty description: the caller raises
                log.warning("direct transfer %s: bad describe request: %s", self._endpoint, e)
                msg = None
            with self._lock:
                regions = list(self._exports.values()) if isinstance(msg, Describe) else []
            self._sock.send(_enc.encode(Description(self.protocol, self.host_id, self.pid, regions, self._probe,
                                                    self._probe_region, self._nonce, self._gen.path,
                                                    self._gen.get())))

    def endpoint(self) -> str:
        return self._endpoint

    def _live(self) -> None:
        if self._closed:
            raise TransferError("transfer endpoint is closed")

    # ---- registration -----------------------------------------------------------------------------
    def register(self, ptr: int, nbytes: int) -> None:
        self._live()
        check_range("register", ptr, nbytes)
        self.mover.check_local(ptr, nbytes)
        with self._lock:
            self._regs.add(ptr, nbytes)
            try:
                self._exports[ptr] = Region(ptr, nbytes, self.mover.export(ptr, nbytes))
            except BaseException:
                self._regs.pop(ptr)
                raise

    def unregister(self, ptr: int) -> None:
        """Stop offering ``ptr`` to peers, once no batch of this endpoint touching it runs (waits up
        to ``timeout_s``; :class:`TransferTimeout` after that, and it stays registered). Peers that
        attached it see it gone at their next describe."""
        self._live()
        check_range("unregister", ptr, 1)
        with self._lock:
            if ptr not in self._exports:
                raise ValueError(f"ptr {ptr:#x} is not a registered buffer (register it first)")
        if not self._quiesce(lambda b: any(p == ptr for p, _ in b.locals_), self.timeout_s):
            raise TransferTimeout(f"unregister({ptr:#x}): transfers using it still running after timeout_s="
                                  f"{self.timeout_s:g}; the buffer stays registered")
        with self._lock:
            self._regs.pop(ptr)
            del self._exports[ptr]
            self._gen.set(self._gen.get() + 1)  # importers re-describe before their next copy

    def registered_buffers(self) -> list[tuple[int, int]]:
        return self._regs.items()

    # ---- peers ------------------------------------------------------------------------------------
    def _describe(self, peer: str) -> Description:
        import zmq

        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        ms = max(1, int(self.timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, ms)
        sock.setsockopt(zmq.RCVTIMEO, ms)
        try:
            sock.connect(f"tcp://{peer}")
            sock.send(_enc.encode(Describe()))
            reply = _dec.decode(sock.recv())
        except zmq.Again:
            raise TransferTimeout(f"{self.protocol} peer {peer!r} did not answer within {self.timeout_s:g} s "
                                  "(gone, hung, or not a direct-transfer endpoint)") from None
        except Exception as e:
            raise TransferError(f"{self.protocol} peer {peer!r}: describe failed ({type(e).__name__}: {e})") from None
        finally:
            sock.close()
        if not isinstance(reply, Description):
            raise TransferError(f"{self.protocol} peer {peer!r} answered {type(reply).__name__}")
        if reply.protocol != self.protocol:
            raise TransferError(f"peer {peer!r} speaks {reply.protocol!r}, this endpoint {self.protocol!r}")
        if reply.host_id != self.host_id:
            raise TransferError(f"{self.protocol}: peer {peer!r} is on another host or pid namespace (host id "
                                f"{reply.host_id}, here {self.host_id}); direct transfer needs both on one host "
                                "(use tcp or rdma across hosts)")
        return reply

    def _peer(self, peer: str, refresh: bool = False) -> _Peer:
        with self._lock:
            p = self._peers.get(peer)
        if p is not None and not refresh:
            return p
        desc = self._describe(peer)
        try:
            gen = _Generation(desc.generation_file)
        except (OSError, ValueError) as e:
            raise TransferError(f"{self.protocol}: peer {peer!r}'s generation file {desc.generation_file!r} cannot "
                                f"be opened ({e}): not on this host, or no shared /dev/shm") from None
        with self._lock:
            old = self._peers.get(peer)
            new = _Peer(desc, sorted(r.base for r in desc.regions), gen=gen)
            if old is not None and old.desc.pid == desc.pid:
                keep = {r.base: r for r in desc.regions}
                for base, (addr, token) in old.mapped.items():
                    r = keep.get(base)
                    old_r = next((x for x in old.desc.regions if x.base == base), None)
                    if r is not None and old_r is not None and r == old_r:
                        new.mapped[base] = (addr, token)
                    else:  # revoked (unregistered or re-registered): drop our mapping
                        self._detach(token)
                new.probed = old.probed
            elif old is not None:
                self._drop(old)
            if old is not None and old.gen is not None:
                old.gen.close()
            self._peers[peer] = new
        return new

    def probe(self, peer: str) -> None:
        """Check the path to ``peer`` works (describe, attach, read its probe word);
        :class:`TransferError` naming why not. The p2p handshake calls this before choosing the
        protocol; transfers call it once per peer."""
        self._live()
        check_peer("probe", peer)
        p = self._peer(peer)
        if p.probed:
            return
        d = p.desc
        try:
            addr, token = self.mover.attach(d.pid, d.probe_region.base, d.probe_region.nbytes, d.probe_region.handle)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"{self.protocol}: cannot attach peer {peer!r} (pid {d.pid}): "
                                f"{type(e).__name__}: {e}") from None
        try:
            got = self._read_word(d.pid, addr + (d.probe - d.probe_region.base))
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"{self.protocol}: cannot read peer {peer!r}'s memory (pid {d.pid}): "
                                f"{type(e).__name__}: {e}") from None
        finally:
            self.mover.detach(token)
        if got != d.nonce:
            raise TransferError(f"{self.protocol}: probe of peer {peer!r} read {got:#x}, expected {d.nonce:#x}")
        p.probed = True

    def _read_word(self, pid: int, target: int) -> int:
        scratch = self.mover.scratch()
        one = lambda v: np.asarray([v], dtype=np.int64)  # noqa: E731
        ticket = self.mover.submit("read", pid, one(scratch.address), one(target), one(8))
        try:
            deadline = time.monotonic() + self.timeout_s
            while not self.mover.done(ticket):
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"{self.protocol}: probe read did not finish within {self.timeout_s:g} s")
                time.sleep(0.0002)
        finally:
            self.mover.release(ticket)
        return scratch.value()

    def _translate(self, peer: str, remote: np.ndarray, lengths: np.ndarray) -> tuple[int, np.ndarray]:
        """Peer addresses -> addresses this process copies to (attaching regions as needed)."""
        p = self._peer(peer)
        self._alive(peer, p.desc.pid)  # a dead peer fails at once, not after a describe timeout
        g = p.gen.get() if p.gen is not None else p.desc.generation
        if g == CLOSED:
            with self._lock:
                if self._peers.get(peer) is p:
                    del self._peers[peer]
                self._drop(p)
            raise TransferError(f"{self.protocol}: peer {peer!r} closed its endpoint; its memory was released here")
        if g != p.desc.generation:  # the peer unregistered something: forget what it revoked
            p = self._peer(peer, refresh=True)
        if not p.probed:
            self.probe(peer)
        try:
            return p.desc.pid, self._map(p, peer, remote, lengths)
        except _Miss:
            p = self._peer(peer, refresh=True)  # registered since we asked, or revoked
            try:
                return p.desc.pid, self._map(p, peer, remote, lengths)
            except _Miss as m:
                raise TransferError(f"{self.protocol}: remote range [{m.ptr:#x}, +{m.n}) at {peer!r} is not inside "
                                    "a buffer the peer registered") from None

    def _map(self, p: _Peer, peer: str, remote: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        regions = sorted(p.desc.regions, key=lambda r: r.base)
        if not regions:
            raise _Miss(int(remote[0]), int(lengths[0]))
        starts = np.asarray([r.base for r in regions], dtype=np.int64)
        ends = np.asarray([r.base + r.nbytes for r in regions], dtype=np.int64)
        i = np.searchsorted(starts, remote, side="right") - 1
        bad = (i < 0) | (remote + lengths > ends[np.maximum(i, 0)])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise _Miss(int(remote[k]), int(lengths[k]))
        local_base = np.empty(len(regions), dtype=np.int64)
        for k in np.unique(i).tolist():
            r = regions[k]
            m = p.mapped.get(r.base)
            if m is None:
                try:
                    m = p.mapped[r.base] = self.mover.attach(p.desc.pid, r.base, r.nbytes, r.handle)
                except TransferError:
                    raise
                except Exception as e:
                    raise TransferError(f"{self.protocol}: cannot attach region {r.base:#x} of peer {peer!r}: "
                                        f"{type(e).__name__}: {e}") from None
            local_base[k] = m[0]
        return local_base[i] + (remote - starts[i])

    def _detach(self, token: Any) -> None:
        try:
            self.mover.detach(token)
        except Exception as e:  # a failed unmap must not hide the error being raised
            log.warning("direct transfer: detach failed: %s", e)

    def _drop(self, p: _Peer) -> None:
        for _, token in p.mapped.values():
            self._detach(token)
        p.mapped.clear()

    def _alive(self, peer: str, pid: int) -> None:
        if pid == self.pid:
            return
        try:
            os.kill(pid, 0)
            return
        except ProcessLookupError:
            pass
        except PermissionError:
            return
        with self._lock:
            p = self._peers.pop(peer, None)
            if p is not None:
                self._drop(p)
                if p.gen is not None:
                    p.gen.close()
        raise TransferError(f"{self.protocol}: peer {peer!r} (pid {pid}) has exited; its memory was released here")

    # ---- transfers --------------------------------------------------------------------------------
    def _check(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int]
               ) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
        """Validate (vectorized; the slow per-item checks only to name a bad item) and return the
        registered local buffers touched and the three lists as arrays."""
        check_peer(op, peer)
        names = ("src_ptrs", "dst_ptrs") if op.endswith("write") else ("local_ptrs", "remote_ptrs")
        ok = _ints(local) and _ints(remote) and _ints(lengths) and len(local) == len(remote) == len(lengths) > 0
        if ok:
            try:
                la, ra, na = (np.asarray(v, dtype=np.int64) for v in (local, remote, lengths))
            except OverflowError:
                ok = False
        if ok:
            small = (la > 0) & (ra > 0) & (na > 0) & (la < ADDRESS_LIMIT) & (ra < ADDRESS_LIMIT) & (na < ADDRESS_LIMIT)
            ok = bool(small.all() and (la + na <= ADDRESS_LIMIT).all() and (ra + na <= ADDRESS_LIMIT).all())
        if not ok:
            check_segments(op, local, lengths, remote, names)  # raises naming the argument and item
            raise ValueError(f"{op}: invalid segments")  # (not reached: check_segments found it)
        with self._lock:
            regs = self._regs.items()
        starts = np.asarray([p for p, _ in regs] or [0], dtype=np.int64)
        ends = np.asarray([p + n for p, n in regs] or [0], dtype=np.int64)
        j = np.searchsorted(starts, la, side="right") - 1
        bad = (j < 0) | (la + na > ends[np.maximum(j, 0)]) if regs else np.ones(len(la), bool)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise TransferError(f"{op}: local range [{local[i]:#x}, +{lengths[i]}) at {names[0]}[{i}] is not inside "
                                "a registered buffer; call register() first")
        touched = [regs[k] for k in np.unique(j).tolist()]
        return touched, la, ra, na

    def submit_write(self, peer: str, src_ptrs: list[int], dst_ptrs: list[int], lengths: list[int],
                     after: Any = None) -> int:
        """As :meth:`Transfer.submit_write`; ``after``: an event of this endpoint's device (e.g.
        recorded by a forward after it wrote a layer's KV) the copies start after. Where the mover
        ``orders_after`` the copy streams wait for it on the device (the host goes on); otherwise the
        host waits for it here, before submitting."""
        return self._submit("write", peer, src_ptrs, dst_ptrs, lengths, after)

    def submit_read(self, peer: str, local_ptrs: list[int], remote_ptrs: list[int], lengths: list[int],
                    after: Any = None) -> int:
        return self._submit("read", peer, local_ptrs, remote_ptrs, lengths, after)

    @property
    def orders_after(self) -> bool:
        return self.mover.orders_after

    def _submit(self, op: str, peer: str, local: list[int], remote: list[int], lengths: list[int],
                after: Any = None) -> int:
        self._live()
        touched, la, ra, na = self._check(f"submit_{op}", peer, local, remote, lengths)
        pid, target = self._translate(peer, ra, na)
        lp, tp, ln = _merge(la, target, na)
        nbytes = int(ln.sum())
        if after is not None and not self.mover.orders_after:
            after.synchronize()
            after = None
        try:
            ticket = self.mover.submit(op, pid, lp, tp, ln) if after is None else \
                self.mover.submit(op, pid, lp, tp, ln, after=after)
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"submit_{op} with {peer!r} ({len(ln)} runs, {nbytes} B): "
                                f"{type(e).__name__}: {e}") from None
        with self._lock:
            batch = next(self._ids)
            self._batches[batch] = _Batch(op, peer, ticket, nbytes, touched)
        return batch

    def poll(self, batch: int) -> bool:
        self._live()
        with self._lock:
            b = self._batches.get(batch) if not isinstance(batch, bool) else None
        if b is None:
            raise ValueError(f"batch={batch!r} is not a pending transfer batch of this endpoint")
        try:
            if not self.mover.done(b.ticket):
                return False
            err = None
        except Exception as e:
            err = e
        with self._lock:
            self._batches.pop(batch, None)
        self.mover.release(b.ticket)
        if err is not None:
            raise TransferError(f"{b.op} batch {batch} with {b.peer!r} ({b.nbytes} B) failed: "
                                f"{type(err).__name__}: {err}") from None
        return True

    def wait(self, batch: int, timeout_s: float | None = None) -> None:
        """Poll ``batch`` until done; :class:`TransferTimeout` after ``timeout_s`` (default: the
        endpoint's ``timeout_s`` plus 1 s per GiB of the batch)."""
        if timeout_s is None:
            with self._lock:
                b = self._batches.get(batch) if not isinstance(batch, bool) else None
            timeout_s = self.timeout_s + (b.nbytes if b else 0) / (1 << 30)
        deadline = time.monotonic() + timeout_s
        spins = 0
        while not self.poll(batch):
            if time.monotonic() > deadline:
                raise TransferTimeout(f"transfer batch {batch} did not complete within {timeout_s:g} s")
            spins += 1
            if spins > 50:  # copies of a few MiB end in microseconds: spin first, then sleep
                time.sleep(0.0001)

    def _quiesce(self, which: Callable[[_Batch], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = [(i, b) for i, b in self._batches.items() if which(b)]
            if not pending:
                return True
            for i, b in pending:
                try:
                    done = self.mover.done(b.ticket)
                except Exception:
                    done = True
                if done:
                    with self._lock:
                        self._batches.pop(i, None)
                    self.mover.release(b.ticket)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._batches)

    def close(self) -> None:
        """Stop serving, wait for batches in flight (up to ``timeout_s``), detach every peer region
        and forget the registrations. Idempotent. If copies are still running after ``timeout_s``
        the peer mappings stay (a copy may still use them) and a warning is logged."""
        if self._closed:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        done = self._quiesce(lambda b: True, self.timeout_s)
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            self._regs, self._exports = Registrations(), {}
        self._gen.close()
        for p in peers:
            if p.gen is not None:
                p.gen.close()
        if done:
            for p in peers:
                self._drop(p)
            self.mover.close()
        else:
            log.warning("DirectTransfer.close(%s): copies still running after timeout_s=%g; peer mappings are "
                        "left until the process exits", self._endpoint, self.timeout_s)
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> DirectTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Miss(Exception):
    def __init__(self, ptr: int, n: int):
        self.ptr, self.n = ptr, n


class _HostScratch:
    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(8)
        self.address = ctypes.addressof(self.buf)

    def value(self) -> int:
        return struct.unpack("<Q", self.buf.raw)[0]


# ---- cma: host memory through cross-memory attach ---------------------------------------------------
class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


IOV_MAX = 1024
_libc: Any = None


def _vm_call(op: str, pid: int, local: list[int], target: list[int], lengths: list[int]) -> None:
    """``process_vm_writev`` / ``process_vm_readv`` in chunks of ``IOV_MAX``, retrying short copies."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        for fn in (_libc.process_vm_readv, _libc.process_vm_writev):
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                           ctypes.c_ulong]
    fn = _libc.process_vm_writev if op == "write" else _libc.process_vm_readv
    segs = list(zip(local, target, lengths))
    while segs:
        part, segs = segs[:IOV_MAX], segs[IOV_MAX:]
        n = len(part)
        liov, riov = (_Iovec * n)(), (_Iovec * n)()
        for i, (a, b, m) in enumerate(part):
            liov[i].base, liov[i].len, riov[i].base, riov[i].len = a, m, b, m
        want = sum(m for _, _, m in part)
        got = fn(pid, ctypes.addressof(liov), n, ctypes.addressof(riov), n, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process_vm_{op}v(pid {pid}): {os.strerror(err)}"
                          + (" (ptrace permission over the peer is needed: same user, no Yama/seccomp restriction)"
                             if err == 1 else ""))
        if got < want:  # partial: skip what was copied and go on with the rest
            rest, skip = [], got
            for a, b, m in part:
                if skip >= m:
                    skip -= m
                    continue
                rest.append((a + skip, b + skip, m - skip))
                skip = 0
            segs = rest + segs


def _memmove(op: str, local: list[int], target: list[int], lengths: list[int]) -> None:
    for a, b, n in zip(local, target, lengths):
        if op == "write":
            ctypes.memmove(b, a, n)
        else:
            ctypes.memmove(a, b, n)


class HostMover(Mover):
    """``cma``: host memory of a process on this host (cross-memory attach; ``memmove`` in-process).
    Copies run on a small thread pool (the syscalls release the GIL), so ``submit`` returns at once."""

    protocol = "cma"

    def __init__(self, workers: int = 2):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cma-copy")

    def export(self, ptr: int, nbytes: int) -> bytes:
        return b""  # the peer addresses our memory by pid and virtual address

    def attach(self, pid: int, base: int, nbytes: int, handle: bytes) -> tuple[int, Any]:
        return base, None

    def detach(self, token: Any) -> None:
        return None

    def submit(self, op: str, pid: int, local: np.ndarray, target: np.ndarray, lengths: np.ndarray) -> Future:
        local, target, lengths = (np.asarray(v).tolist() for v in (local, target, lengths))
        if pid == os.getpid():
            return self._pool.submit(_memmove, op, local, target, lengths)
        return self._pool.submit(_vm_call, op, pid, local, target, lengths)

    def done(self, ticket: Future) -> bool:
        if not ticket.done():
            return False
        ticket.result()  # raises the copy's error
        return True

    def close(self) -> None:
        self._pool.shutdown(wait=False)

"""``cuda_ipc``: device-direct transfer between processes (and GPUs) of one host through CUDA IPC
memory handles — the primitive behind NIXL/UCX ``cuda_ipc``, vLLM's custom all-reduce and Mooncake's
intra-node NVLink transport.

* **Export** (``register``): ``cudaIpcGetMemHandle`` of the allocation holding the range (its base
  found with ``cuMemGetAddressRange``) plus the range's offset in it. PyTorch's caching allocator
  hands out ``cudaMalloc`` segments, which export; memory from expandable segments
  (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, ``cuMemCreate``) does not, and ``register``
  says so.
* **Attach** (first use by a peer): ``cudaIpcOpenMemHandle(..., cudaIpcMemLazyEnablePeerAccess)``
  on the local GPU, once per allocation per process (reference counted; a handle cannot be opened
  twice in one process, nor in the process that exported it, which uses its own pointer).
* **Copy**: runs contiguous on both sides are already merged by :class:`~hwkv.transfer.direct.
  DirectTransfer`. ``method="memcpy"``: one ``cudaMemcpyAsync`` per run on the copy engines,
  round-robin over ``streams`` streams; ``"batch"``: one ``cudaMemcpyBatchAsync`` (CUDA >= 12.8)
  per stream; ``"kernel"``: one Triton launch whose programs copy the runs with the SMs (loads and
  stores over NVLink), for many small runs where a copy-engine launch per run costs more than the
  bytes; ``"auto"``: memcpy for few or large runs, the kernel otherwise. Completion: one CUDA event
  per stream, queried (never waited on) by ``done``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from typing import Any

import numpy as np
import torch

from hwkv.interfaces.transfer import TransferError
from hwkv.transfer.direct import Mover

log = logging.getLogger(__name__)
_NOT_READY = 600  # cudaErrorNotReady
_PEER_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_MEMCPY_DEFAULT = 4
_LAZY_PEER = 1  # cudaIpcMemLazyEnablePeerAccess
METHODS = ("auto", "memcpy", "batch", "kernel")
# auto: the copy engines while runs are few or large (no SMs taken from the forwards), the SM kernel
# for many small runs (a copy-engine launch per 64 KiB run costs more than its bytes)
AUTO_KERNEL_MIN_RUNS = 64
AUTO_KERNEL_MAX_MEAN = 1 << 20


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _PtrAttrs(ctypes.Structure):
    # CUDA 13 appends ``long reserved[8]``: without it the runtime writes past the struct
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 8)]


class _MemLoc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLoc), ("dstLocHint", _MemLoc),
                ("flags", ctypes.c_uint)]


def _find(name: str) -> str:
    """The path of an already loaded library (torch loads its own libcudart)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        pass
    return ""


class _Cuda:
    """The runtime and driver calls we need, through ctypes (no extra dependency)."""

    _instance: _Cuda | None = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> _Cuda:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        torch.cuda.init()
        path = _find("libcudart.so")
        names = [path] if path else [f"libcudart.so.{v}" for v in ("13", "12")]
        rt = None
        for n in names:
            try:
                rt = ctypes.CDLL(n)
                break
            except OSError:
                continue
        if rt is None:
            raise TransferError("cuda_ipc: libcudart could not be loaded (looked in this process and for "
                                "libcudart.so.13/.12)")
        self.rt, self.drv = rt, ctypes.CDLL(_find("libcuda.so") or "libcuda.so.1")
        c = ctypes
        sigs = {
            "cudaSetDevice": [c.c_int],
            "cudaGetErrorString": [c.c_int],
            "cudaRuntimeGetVersion": [c.POINTER(c.c_int)],
            "cudaIpcGetMemHandle": [c.POINTER(_Handle), c.c_void_p],
            "cudaIpcOpenMemHandle": [c.POINTER(c.c_void_p), _Handle, c.c_uint],
            "cudaIpcCloseMemHandle": [c.c_void_p],
            "cudaMemcpyAsync": [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_void_p],
            "cudaEventCreateWithFlags": [c.POINTER(c.c_void_p), c.c_uint],
            "cudaEventRecord": [c.c_void_p, c.c_void_p],
            "cudaEventQuery": [c.c_void_p],
            "cudaEventDestroy": [c.c_void_p],
            "cudaPointerGetAttributes": [c.POINTER(_PtrAttrs), c.c_void_p],
            "cudaDeviceEnablePeerAccess": [c.c_int, c.c_uint],
            "cudaGetLastError": [],
        }
        for name, args in sigs.items():
            fn = getattr(rt, name)
            fn.argtypes, fn.restype = args, c.c_int
        rt.cudaGetErrorString.restype = c.c_char_p
        self.drv.cuMemGetAddressRange_v2.argtypes = [c.POINTER(c.c_uint64), c.POINTER(c.c_size_t), c.c_uint64]
        self.drv.cuMemGetAddressRange_v2.restype = c.c_int
        v = c.c_int(0)
        rt.cudaRuntimeGetVersion(c.byref(v))
        self.version = v.value
        self.batch = getattr(rt, "cudaMemcpyBatchAsync", None)
        if self.batch is not None:
            self.batch.restype = c.c_int

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.rt.cudaGetLastError()  # clear the sticky-free error so later calls are not blamed
            msg = self.rt.cudaGetErrorString(rc).decode(errors="replace")
            raise TransferError(f"cuda_ipc: {what} failed: {msg} (cudaError {rc})")


class _Opened:
    """Process-wide: handles opened here (an allocation can be opened once per process)."""

    lock = threading.Lock()
    maps: dict[bytes, list[int]] = {}  # handle -> [mapped base, refcount]


class _Events:
    def __init__(self, events: list[int]):
        self.events = events


class CudaIpcMover(Mover):
    protocol = "cuda_ipc"
    orders_after = True  # copy streams wait on the caller's event (cudaStreamWaitEvent): no host stall

    def __init__(self, device: int | torch.device | None = None, method: str = "auto", streams: int = 2):
        if method not in METHODS:
            raise ValueError(f"cuda_ipc: method={method!r} is invalid (allowed: {', '.join(METHODS)})")
        if isinstance(streams, bool) or not isinstance(streams, int) or not 1 <= streams <= 16:
            raise ValueError(f"cuda_ipc: streams={streams!r} is invalid (allowed: 1..16)")
        self.cuda = _Cuda.get()
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"cuda_ipc: device {dev} is not a CUDA device")
        self.device = dev.index if dev.index is not None else torch.cuda.current_device()
        self.method = method
        if method == "batch" and self.cuda.batch is None:
            raise TransferError(f"cuda_ipc: method 'batch' needs cudaMemcpyBatchAsync (CUDA >= 12.8; runtime "
                                f"{self.cuda.version})")
        self.streams = [torch.cuda.Stream(self.device) for _ in range(streams)]
        self._rr = 0
        self._kernel_ok = method in ("auto", "kernel") and self._warm_kernel()

    def _warm_kernel(self) -> bool:
        """Compile the SM copy kernel now (a copy of two runs within this GPU): its first launch JIT-compiles
        for about a second, which would otherwise land on the first request's transfer (its TTFT)."""
        try:
            buf = torch.arange(64, dtype=torch.int64, device=f"cuda:{self.device}")
            torch.cuda.current_stream(self.device).synchronize()
            p = buf.data_ptr()
            _kernel_copy(self.device, self.streams[0], np.asarray([p, p + 256], np.int64),
                         np.asarray([p + 128, p + 384], np.int64), np.asarray([128, 128], np.int64))
            self.streams[0].synchronize()
            if buf[16:32].tolist() != list(range(16)):
                raise RuntimeError("the warm-up copy moved the wrong bytes")
            return True
        except Exception as e:
            if self.method == "kernel":
                raise TransferError(f"cuda_ipc: the copy kernel failed: {type(e).__name__}: {e}") from None
            log.warning("cuda_ipc: the SM copy kernel is unavailable (%s: %s); using the copy engines",
                        type(e).__name__, e)
            return False

    # ---- memory -------------------------------------------------------------------------------------
    def _set(self) -> None:
        self.cuda.check(self.cuda.rt.cudaSetDevice(self.device), f"cudaSetDevice({self.device})")

    def check_local(self, ptr: int, nbytes: int) -> None:
        a = _PtrAttrs()
        rc = self.cuda.rt.cudaPointerGetAttributes(ctypes.byref(a), ctypes.c_void_p(ptr))
        if rc != 0 or a.type != 2:  # cudaMemoryTypeDevice
            self.cuda.rt.cudaGetLastError()
            raise TransferError(f"cuda_ipc: [{ptr:#x}, +{nbytes}) is not CUDA device memory (cuda_ipc moves device "
                                "memory; host memory goes over tcp or cma)")

    def export(self, ptr: int, nbytes: int) -> bytes:
        self._set()
        base, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
        rc = self.cuda.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr)
        if rc != 0:
            raise TransferError(f"cuda_ipc: cuMemGetAddressRange({ptr:#x}) failed (CUresult {rc})")
        if ptr + nbytes > base.value + size.value:
            raise TransferError(f"cuda_ipc: [{ptr:#x}, +{nbytes}) spans several allocations (register each)")
        h = _Handle()
        rc = self.cuda.rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base.value))
        if rc != 0:
            self.cuda.rt.cudaGetLastError()
            raise TransferError(
                f"cuda_ipc: cudaIpcGetMemHandle({base.value:#x}) failed (cudaError {rc}): the memory cannot be "
                "shared with other processes — PyTorch expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True) or cudaMallocAsync pools do not export; use the default caching "
                "allocator for the KV cache")
        dev = self._device_of(ptr)
        return ctypes.string_at(ctypes.addressof(h), 64) + struct.pack("<Qi", ptr - base.value, dev)  # raw: has NULs

    def _device_of(self, ptr: int) -> int:
        a = _PtrAttrs()
        self.cuda.check(self.cuda.rt.cudaPointerGetAttributes(ctypes.byref(a), ctypes.c_void_p(ptr)),
                        "cudaPointerGetAttributes")
        return a.device

    def attach(self, pid: int, base: int, nbytes: int, handle: bytes) -> tuple[int, Any]:
        offset, dev = struct.unpack("<Qi", handle[64:76])
        self._set()
        if pid == os.getpid():  # our own memory (two endpoints of one process)
            if dev != self.device:
                rc = self.cuda.rt.cudaDeviceEnablePeerAccess(dev, 0)
                if rc not in (0, _PEER_ENABLED):
                    self.cuda.rt.cudaGetLastError()
                    raise TransferError(f"cuda_ipc: no peer access from GPU {self.device} to GPU {dev} (cudaError "
                                        f"{rc})")
                self.cuda.rt.cudaGetLastError()
            return base, None
        key = bytes(handle[:64]) + struct.pack("<i", self.device)
        with _Opened.lock:
            m = _Opened.maps.get(key)
            if m is None:
                h = _Handle()
                ctypes.memmove(ctypes.addressof(h), bytes(handle[:64]), 64)  # raw bytes (a handle holds NULs)
                out = ctypes.c_void_p(0)
                self.cuda.check(self.cuda.rt.cudaIpcOpenMemHandle(ctypes.byref(out), h, _LAZY_PEER),
                                f"cudaIpcOpenMemHandle (peer pid {pid}, GPU {dev} -> GPU {self.device})")
                m = _Opened.maps[key] = [out.value, 0]
            m[1] += 1
        return m[0] + offset, key

    def detach(self, token: Any) -> None:
        if token is None:
            return
        with _Opened.lock:
            m = _Opened.maps.get(token)
            if m is None:
                return
            m[1] -= 1
            if m[1] > 0:
                return
            del _Opened.maps[token]
        self._set()
        self.cuda.check(self.cuda.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(m[0])), "cudaIpcCloseMemHandle")

    def probe_memory(self, nonce: int) -> tuple[int, Any]:
        t = torch.zeros(8, dtype=torch.int64, device=f"cuda:{self.device}")
        t[0] = nonce if nonce < (1 << 63) else nonce - (1 << 64)
        torch.cuda.synchronize(self.device)
        return t.data_ptr(), t

    def scratch(self) -> Any:
        return _DeviceScratch(self.device)

    # ---- copies -------------------------------------------------------------------------------------
    def _choose(self, lengths: np.ndarray, local: np.ndarray, target: np.ndarray) -> str:
        fits = _kernel_fits(local, target, lengths)
        if self.method == "kernel":
            return "kernel" if fits else "memcpy"  # unaligned runs (e.g. the 8-byte probe) on the copy engines
        if self.method != "auto":
            return self.method
        if len(lengths) < AUTO_KERNEL_MIN_RUNS or int(lengths.sum()) >= AUTO_KERNEL_MAX_MEAN * len(lengths):
            return "memcpy"
        if self._kernel_ok and fits:
            return "kernel"
        return "batch" if self.cuda.batch is not None else "memcpy"

    def submit(self, op: str, pid: int, local: np.ndarray, target: np.ndarray, lengths: np.ndarray,
               after: Any = None) -> Any:
        local, target, lengths = (np.asarray(v, dtype=np.int64) for v in (local, target, lengths))
        src, dst = (local, target) if op == "write" else (target, local)
        method = self._choose(lengths, local, target)
        self._set()
        if after is not None:  # every stream this call may use waits, on the device, for the event
            for s in self.streams:
                s.wait_event(after)
        if method == "kernel":
            stream = self.streams[0]
            try:
                _kernel_copy(self.device, stream, src, dst, lengths)
                return _Events([self._record(stream)])
            except Exception as e:  # e.g. no Triton: the copy engines do it
                if self.method == "kernel":
                    raise TransferError(f"cuda_ipc: the copy kernel failed: {type(e).__name__}: {e}") from None
                log.warning("cuda_ipc: the SM copy kernel failed (%s: %s); using the copy engines", type(e).__name__, e)
                self._kernel_ok = False
                method = "batch" if self.cuda.batch is not None else "memcpy"
        used = self.streams[: max(1, min(len(self.streams), len(lengths)))]
        k = len(used)
        if method == "batch":
            for i, s in enumerate(used):
                self._batch(dst[i::k], src[i::k], lengths[i::k], s)
        else:
            memcpy = self.cuda.rt.cudaMemcpyAsync
            handles = [ctypes.c_void_p(s.cuda_stream) for s in used]
            for i, (d, s_, n) in enumerate(zip(dst.tolist(), src.tolist(), lengths.tolist())):
                rc = memcpy(d, s_, n, _MEMCPY_DEFAULT, handles[i % k])
                if rc != 0:
                    self.cuda.check(rc, f"cudaMemcpyAsync of run {i} ({n} B)")
        return _Events([self._record(s) for s in used])

    def _batch(self, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, stream: Any) -> None:
        n = len(lengths)
        if not n:
            return
        d, s, z = (np.ascontiguousarray(v, dtype=np.uint64) for v in (dst, src, lengths))  # kept alive: the call
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        attrs = _MemcpyAttrs(1, _MemLoc(0, 0), _MemLoc(0, 0), 0)  # cudaMemcpySrcAccessOrderStream
        idx = (ctypes.c_size_t * 1)(0)
        h = ctypes.c_void_p(stream.cuda_stream)
        if self.cuda.version >= 13000:
            rc = self.cuda.batch(ptr(d), ptr(s), ptr(z), ctypes.c_size_t(n), ctypes.byref(attrs), idx,
                                 ctypes.c_size_t(1), h)
        else:
            fail = ctypes.c_size_t(0)
            rc = self.cuda.batch(ptr(d), ptr(s), ptr(z), ctypes.c_size_t(n), ctypes.byref(attrs), idx,
                                 ctypes.c_size_t(1), ctypes.byref(fail), h)
        self.cuda.check(rc, f"cudaMemcpyBatchAsync of {n} runs")

    def _record(self, stream: Any) -> int:
        ev = ctypes.c_void_p(0)
        self.cuda.check(self.cuda.rt.cudaEventCreateWithFlags(ctypes.byref(ev), 2), "cudaEventCreate")
        self.cuda.check(self.cuda.rt.cudaEventRecord(ev, ctypes.c_void_p(stream.cuda_stream)), "cudaEventRecord")
        return ev.value

    def done(self, ticket: _Events) -> bool:
        while ticket.events:
            rc = self.cuda.rt.cudaEventQuery(ctypes.c_void_p(ticket.events[-1]))
            if rc == _NOT_READY:
                return False
            self.cuda.check(rc, "the copies")
            self.cuda.rt.cudaEventDestroy(ctypes.c_void_p(ticket.events.pop()))
        return True

    def release(self, ticket: _Events) -> None:
        for ev in ticket.events:  # abandoned: destroying a pending event is allowed (freed once it fires)
            self.cuda.rt.cudaEventDestroy(ctypes.c_void_p(ev))
        ticket.events = []


class _DeviceScratch:
    def __init__(self, device: int):
        self.t = torch.zeros(1, dtype=torch.int64, device=f"cuda:{device}")
        # the zero fill runs on the current stream, the probe read on the mover's: without this the fill
        # may land after the read (a probe that "read 0x0" on the H200 pair)
        torch.cuda.current_stream(device).synchronize()
        self.address = self.t.data_ptr()

    def value(self) -> int:
        return int(self.t.item()) & ((1 << 64) - 1)


# ---- the SM copy kernel ---------------------------------------------------------------------------
_KERNEL: Any = None
CHUNK_WORDS = 8192  # 64 KiB of 8-byte words per program


def _kernel_fits(local: np.ndarray, target: np.ndarray, lengths: np.ndarray) -> bool:
    return not bool(((local | target | lengths) & 15).any())


def _get_kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_runs(src_arr, dst_arr, len_arr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
            seg = tl.program_id(0)
            part = tl.program_id(1)
            n = tl.load(len_arr + seg)  # 8-byte words
            start = part * CHUNK
            if start < n:
                src = tl.load(src_arr + seg).to(tl.pointer_type(tl.int64))
                dst = tl.load(dst_arr + seg).to(tl.pointer_type(tl.int64))
                end = tl.minimum(start + CHUNK, n)
                for off in range(start, end, BLOCK):
                    idx = off + tl.arange(0, BLOCK)
                    m = idx < end
                    v = tl.load(src + idx, mask=m, cache_modifier=".cg")
                    tl.store(dst + idx, v, mask=m, cache_modifier=".cg")

        _KERNEL = copy_runs
    return _KERNEL


def _kernel_copy(device: int, stream: Any, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
    kernel = _get_kernel()
    words = lengths // 8
    meta = torch.from_numpy(np.stack([src, dst, words])).pin_memory()
    with torch.cuda.device(device), torch.cuda.stream(stream):
        dmeta = meta.to(f"cuda:{device}", non_blocking=True)
        grid = (len(lengths), -(-int(words.max()) // CHUNK_WORDS))
        kernel[grid](dmeta[0], dmeta[1], dmeta[2], CHUNK=CHUNK_WORDS, BLOCK=1024, num_warps=8)
        dmeta.record_stream(stream)  # (the pinned source is kept by torch's host allocator until copied)

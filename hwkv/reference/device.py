"""The host as a Device: CPU work is synchronous, so streams and events are trivially complete,
copies are plain (no staging) and there are no graphs: the engine runs it eagerly."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import time
import weakref
from contextlib import AbstractContextManager
from typing import Any

from hwkv.interfaces.device import Device


class CpuEvent:
    """torch.cuda.Event look-alike. CPU work is done when it is issued, so ``query`` is always True."""

    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        self._t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: CpuStream | None = None) -> None:
        return None

    def elapsed_time(self, end: CpuEvent) -> float:
        """Milliseconds between two recorded events (like torch.cuda.Event.elapsed_time)."""
        if self._t is None or end._t is None:
            raise RuntimeError("both events must be recorded before elapsed_time")
        return (end._t - self._t) * 1e3


class CpuStream:
    """torch.cuda.Stream look-alike with nothing to order."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_event(self, event: CpuEvent) -> None:
        return None

    def wait_stream(self, stream: CpuStream) -> None:
        return None

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or CpuEvent()
        event.record(self)
        return event


def _host_memory() -> tuple[int, int]:
    info = _meminfo()
    if info is not None:
        return info
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def _meminfo() -> tuple[int, int] | None:
    try:
        with open("/proc/meminfo") as f:
            kv = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return kv["MemAvailable"], kv["MemTotal"]
    except (OSError, KeyError, ValueError):
        return None


class CpuDevice(Device):
    type = "cpu"
    dist_backend = "gloo"

    def __init__(self, index: int = 0):
        super().__init__(index)
        self._default_stream = CpuStream()
        # KV caches this device handed out and still alive, and the host's available memory when
        # none was: see memory_info
        self._live = 0
        self._ceiling: int | None = None
        self._lock = threading.RLock()  # a finalizer may run (GC) inside a locked section

    def description(self) -> str:
        model = platform.processor() or platform.machine()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        return f"{model} ({os.cpu_count()} logical cores)"

    def memory_info(self) -> tuple[int, int]:
        """The host's available memory, less the KV caches this device allocated since none was
        alive. The device counts its own caches because the host's figure lags: in a VM with
        free-page reporting, memory a process freed comes back to ``MemAvailable`` over seconds while
        new allocations reuse it at once, so a fresh cache can leave ``MemAvailable`` unchanged."""
        avail, total = _host_memory()
        with self._lock:
            if self._live == 0:
                self._ceiling = avail
                return avail, total
            return max(0, min(avail, (self._ceiling or avail) - self._live)), total

    def allocate_kv_cache(self, spec: Any, layout: Any, host: bool = False) -> Any:
        kv = super().allocate_kv_cache(spec, layout, host)
        for t in kv.tensors:
            n = t.untyped_storage().nbytes()
            with self._lock:
                if self._live == 0:
                    self._ceiling = _host_memory()[0]
                self._live += n
            weakref.finalize(t, self._release, n)
        return kv

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._live -= nbytes

    def new_stream(self) -> CpuStream:
        return CpuStream()

    def current_stream(self) -> CpuStream:
        return self._default_stream

    def stream_context(self, stream: CpuStream) -> AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_event(self, enable_timing: bool = False) -> CpuEvent:
        return CpuEvent(enable_timing)

    def synchronize(self) -> None:
        return None

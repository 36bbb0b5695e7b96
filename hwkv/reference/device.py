"""The host as a Device: CPU work is synchronous, so streams and events are trivially complete,
copies are plain (no staging) and there are no graphs: the engine runs it eagerly."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from contextlib import AbstractContextManager

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

    def description(self) -> str:
        model = platform.processor() or platform.machine()
        with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
        return f"{model} ({os.cpu_count()} logical cores)"

    def memory_info(self) -> tuple[int, int]:
        info = _meminfo()
        if info is not None:
            return info
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

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

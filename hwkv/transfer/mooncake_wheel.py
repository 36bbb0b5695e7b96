"""The Mooncake wheel as hwkv uses it: finding and loading it, its log level, registration
bookkeeping and the argument checks shared by :class:`~hwkv.transfer.mooncake.MooncakeTransfer`
and :class:`~hwkv.stores.mooncake.MooncakeStore`."""

from __future__ import annotations

import bisect
import ctypes
import importlib
import os
import socket
from collections.abc import Callable
from types import ModuleType

from hwkv.interfaces.transfer import check_range

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
    """Import ``mooncake.<submodule>`` or raise an ImportError that says how to install it; then
    apply the log level (:func:`set_log_level`)."""
    if "MC_LOG_LEVEL" not in os.environ:  # read once by the engine's config, which resets glog's level
        os.environ["MC_LOG_LEVEL"] = "ERROR" if log_level() == "off" else log_level().upper()
    try:
        mod = importlib.import_module(f"mooncake.{submodule}")
    except (ImportError, OSError) as e:  # OSError: a shared library of the wheel is missing
        raise ImportError(f"Mooncake is not usable here ({e}); install it with: {INSTALL_HINT}") from e
    apply_log_level()
    return mod


LOG_LEVELS = {"info": 0, "warning": 1, "error": 2, "off": 3}  # glog severities; 3 = FATAL only
LOG_ENV = "HWKV_MOONCAKE_LOG_LEVEL"
LOG_HINT = f"set {LOG_ENV}=info for Mooncake's own log"
_log_level: str | None = None


def log_level() -> str:
    """The Mooncake log level: :func:`set_log_level`'s, else ``$HWKV_MOONCAKE_LOG_LEVEL``, else
    ``"off"`` (hwkv's errors name what failed; Mooncake's own log is for digging deeper)."""
    level = _log_level or os.environ.get(LOG_ENV, "off").lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"{LOG_ENV}={level!r} is not a log level (allowed: {', '.join(LOG_LEVELS)})")
    return level


def set_log_level(level: str) -> None:
    """Set the level of the Mooncake wheel's glog output (process-wide: ``"info"``, ``"warning"``,
    ``"error"`` or ``"off"``); takes effect at once if Mooncake is loaded."""
    global _log_level
    if level not in LOG_LEVELS:
        raise ValueError(f"level={level!r} is not a Mooncake log level (allowed: {', '.join(LOG_LEVELS)})")
    _log_level = level
    apply_log_level()


def apply_log_level() -> None:
    """Write the level into glog's ``FLAGS_minloglevel`` in the wheel's libglog. Environment
    variables alone cannot do it: ``GLOG_minloglevel`` is overwritten by the engine's config
    (from ``MC_LOG_LEVEL``, which knows no level above ERROR), and that config is loaded lazily."""
    flag = _glog_minloglevel()
    if flag is not None:
        flag.value = LOG_LEVELS[log_level()]


_glog_flag: list[ctypes.c_int] = []  # found once the wheel's libglog is loaded


def _glog_minloglevel() -> ctypes.c_int | None:
    if _glog_flag:
        return _glog_flag[0]
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libglog" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            _glog_flag.append(ctypes.c_int.in_dll(ctypes.CDLL(path), "_ZN3fLI17FLAGS_minloglevelE"))
            return _glog_flag[0]
        except (OSError, ValueError):
            continue
    return None  # glog linked statically (not exported): MC_LOG_LEVEL is all that applies


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
        try:
            rc = call(ptr, nbytes)
        except BaseException:
            self.pop(ptr)
            raise
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



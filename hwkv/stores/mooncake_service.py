"""Run a real ``mooncake_master`` (and memory holders) for ``hwkv pool``, tests and experiments
(tests skip through :func:`hwkv.testing.mooncake.skip_unless_mooncake`).

    with mooncake_master() as m:               # 127.0.0.1, free ports, HTTP metadata server on
        store = MooncakeStore(master=m.master, metadata_server=m.metadata_server)

    with mooncake_master() as m, mooncake_holder(m, 64 << 20):    # a pool that outlives its clients
        store = MooncakeStore(master=m.master, metadata_server=m.metadata_server, global_segment_size=0)

pytest::

    @pytest.fixture(scope="module")
    def master():
        ok, why = mooncake_available()
        if not ok:
            pytest.skip(why)
        with mooncake_master() as m:
            yield m
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from hwkv.transfer.mooncake import INSTALL_HINT, free_port


def die_with_parent() -> None:
    """In the child: get SIGTERM when the test process dies, even by SIGKILL (Linux), so no master
    outlives the run that started it."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True)
class MooncakeMaster:
    """Addresses of a running master: ``master`` (RPC, for clients' ``master_server_addr``),
    ``metadata_server`` (HTTP metadata URL), ``metrics`` (admin/metrics base URL, ``/health``,
    ``/metrics``), the process id, its log file and its ``(rpc, http, metrics)`` ports (pass them
    to :func:`mooncake_master` to start a master in its place)."""

    master: str
    metadata_server: str
    metrics: str
    pid: int
    log_path: str
    ports: tuple[int, int, int] = (0, 0, 0)


def master_binary() -> str | None:
    """The ``mooncake_master`` executable shipped inside the wheel, else one on ``PATH``."""
    spec = importlib.util.find_spec("mooncake")  # locates the package without importing it
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "mooncake_master")
        if os.path.isfile(path):
            return path
    return shutil.which("mooncake_master")


def client_binary() -> str | None:
    """Mooncake's standalone client service (``mooncake_client``, the wheel's "real client"): a
    process that mounts ``--global_segment_size`` bytes of its memory into the pool and keeps them
    there while it lives — the pool's memory holder."""
    spec = importlib.util.find_spec("mooncake")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "mooncake_client")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@functools.lru_cache(maxsize=1)
def mooncake_available() -> tuple[bool, str]:
    """``(True, "")`` when the wheel imports and a master binary exists, else ``(False, reason)``."""
    try:
        importlib.import_module("mooncake.engine")
        importlib.import_module("mooncake.store")
    except (ImportError, OSError) as e:
        return False, f"Mooncake is not usable ({e}); install: {INSTALL_HINT}"
    if master_binary() is None:
        return False, f"mooncake_master not found in the mooncake package or on PATH; install: {INSTALL_HINT}"
    return True, ""


def master_metrics(master: MooncakeMaster) -> dict[str, float]:
    """The master's Prometheus counters (``master_key_count``, ``master_evicted_key_count``, ...).
    Unlike ``exists``/``get`` on a client, reading them grants no lease, so it cannot hold off
    eviction."""
    with urllib.request.urlopen(f"{master.metrics}/metrics", timeout=2) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return True
    return False


def _healthy(metrics: str) -> bool:
    try:
        with urllib.request.urlopen(f"{metrics}/health", timeout=0.5) as r:
            return bool(json.loads(r.read() or b"{}").get("service_ready", True))
    except urllib.error.HTTPError as e:
        return e.code == 404  # an older master without /health: the open ports must do
    except (OSError, ValueError):
        return False


def _tail(path: str, n: int = 2000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


@contextlib.contextmanager
def mooncake_master(
    *,
    default_kv_lease_ttl_ms: int | None = None,
    eviction_high_watermark_ratio: float | None = None,
    eviction_ratio: float | None = None,
    client_ttl_s: int | None = None,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 15.0,
    ports: tuple[int, int, int] | None = None,
) -> Iterator[MooncakeMaster]:
    """Start ``mooncake_master`` on 127.0.0.1 (RPC, HTTP metadata server and metrics on free
    ports, or on ``ports`` — e.g. a stopped master's, to restart it), wait until it serves, yield
    its addresses, then stop it (SIGCONT, SIGTERM, SIGKILL after 5 s: a test may have stopped it).

    Raises ``RuntimeError`` (with the master's log tail) if it exits or is not ready in
    ``timeout_s``; free ports taken between picking and binding are retried twice.
    """
    binary = master_binary()
    if binary is None:
        raise RuntimeError(f"mooncake_master not found; install: {INSTALL_HINT}")
    opts = {
        "default_kv_lease_ttl": default_kv_lease_ttl_ms,
        "eviction_high_watermark_ratio": eviction_high_watermark_ratio,
        "eviction_ratio": eviction_ratio,
        "client_ttl": client_ttl_s,
    }
    log_fd, log_path = tempfile.mkstemp(prefix="mooncake_master_", suffix=".log")
    os.close(log_fd)
    try:
        yield from _run(binary, opts, extra_args, timeout_s, log_path, ports)
    finally:
        os.unlink(log_path)


def _run(
    binary: str, opts: dict, extra_args: tuple[str, ...], timeout_s: float, log_path: str,
    ports: tuple[int, int, int] | None,
) -> Iterator[MooncakeMaster]:
    attempts = 1 if ports else 3
    for attempt in range(attempts):
        rpc, http, metrics_port = ports or (free_port(), free_port(), free_port())
        metrics = f"http://127.0.0.1:{metrics_port}"
        cmd = [
            binary,
            "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
            "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={http}",
            "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}", "--enable_metric_reporting=false",
            *(f"--{k}={v}" for k, v in opts.items() if v is not None),
            *extra_args,
        ]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=die_with_parent)
        try:
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                if _port_open(rpc) and _port_open(http) and _healthy(metrics):
                    break
                time.sleep(0.05)
            else:
                if proc.poll() is not None and attempt < attempts - 1 and "ddress already in use" in _tail(log_path):
                    continue
                raise RuntimeError(f"mooncake_master did not become ready ({' '.join(cmd)}):\n{_tail(log_path)}")
            yield MooncakeMaster(f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata", metrics, proc.pid,
                                 log_path, (rpc, http, metrics_port))
            return
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # a stopped process would not act on SIGTERM
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


@dataclass(frozen=True)
class MooncakeHolder:
    """A running memory holder: its process id, the bytes it contributes, its service port, log, and
    ``segment``: the ``host:port`` its memory is known by in the pool (the endpoint a value's replica
    descriptor names, :meth:`~hwkv.stores.mooncake.MooncakeStore.locate`)."""

    pid: int
    capacity_bytes: int
    port: int
    log_path: str
    segment: str = ""


def holder_command(binary: str, master: str, metadata_server: str, capacity_bytes: int, host: str = "127.0.0.1",
                   port: int = 0, protocol: str = "tcp", threads: int = 8, segment_port: int = 0) -> list[str]:
    """The ``mooncake_client`` command line of a holder contributing ``capacity_bytes`` (its own
    staging buffer is 0: it only serves its segment). ``host`` is the address other clients reach
    its segment at; engines on this host attach at ``port`` (holder mode, shared memory), served
    by ``threads`` service threads (one engine per accelerator of the host may call at once).
    ``segment_port`` fixes the port of its segment's name (``host:segment_port``, what replica
    descriptors name), so engines can tell which holder has a value (else the wheel picks one)."""
    name = f"{host}:{segment_port}" if segment_port else host
    return [binary, f"--master_server_address={master}", f"--metadata_server={metadata_server}",
            f"--global_segment_size={capacity_bytes}", "--local_buffer_size=0", f"--host={name}",
            f"--port={port or free_port()}", f"--protocol={protocol}", f"--threads={threads}"]


def pool_capacity(metrics_url: str) -> float:
    """The bytes every mounted segment gives the pool (the master's ``master_total_capacity_bytes``)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=2) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return float(line.split()[1])
    return 0.0


def wait_mounted(proc: subprocess.Popen, metrics_url: str, before: float, capacity_bytes: int, timeout_s: float,
                 log_path: str | None = None) -> None:
    """Wait until the master counts ``capacity_bytes`` more than ``before`` (the holder's segment is
    mounted); ``RuntimeError`` with the holder's log tail if it exits or does not mount in time."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if pool_capacity(metrics_url) >= before + capacity_bytes:
                return
        time.sleep(0.05)
    tail = _tail(log_path) if log_path else ""
    state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not mounted in {timeout_s:g} s"
    raise RuntimeError(f"mooncake_client (pool memory holder) {state}:\n{tail}")


def stop(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGCONT + SIGTERM, SIGKILL after ``grace_s`` (a test may have stopped it)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def mooncake_holder(master: MooncakeMaster, capacity_bytes: int = 64 << 20, *,
                    timeout_s: float = 15.0, threads: int = 8) -> Iterator[MooncakeHolder]:
    """Start a memory holder (``mooncake_client``) contributing ``capacity_bytes`` to ``master``'s
    pool, wait until its segment is mounted, yield it, then stop it. Values put by any client
    (engines with ``global_segment_size=0`` included) live in holders' segments, so they outlive
    the client that put them — until the holder exits."""
    binary = client_binary()
    if binary is None:
        raise RuntimeError(f"mooncake_client not found in the mooncake package; install: {INSTALL_HINT}")
    log_fd, log_path = tempfile.mkstemp(prefix="mooncake_holder_", suffix=".log")
    os.close(log_fd)
    port, segment_port = free_port(), free_port()
    try:
        before = pool_capacity(master.metrics)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(holder_command(binary, master.master, master.metadata_server, capacity_bytes,
                                                   port=port, threads=threads, segment_port=segment_port),
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=die_with_parent)
        try:
            wait_mounted(proc, master.metrics, before, capacity_bytes, timeout_s, log_path)
            yield MooncakeHolder(proc.pid, capacity_bytes, port, log_path, f"127.0.0.1:{segment_port}")
        finally:
            stop(proc)
    finally:
        os.unlink(log_path)

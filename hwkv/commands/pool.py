"""``hwkv pool``: run and inspect the Mooncake pool behind the global KV pool connector.

    hwkv pool master [--capacity 1GiB] [--holders 1] [--host 127.0.0.1] [--port 50051] [--http-port 8080]
                     [--metrics-port 9003]
    hwkv pool holder --master HOST:PORT --metadata-server URL --capacity 4GiB [--host ADDR] [--segment-port P]
    hwkv pool stats [--metrics http://127.0.0.1:9003] [--json]

``master`` runs ``mooncake_master`` in the foreground with an HTTP metadata server (no etcd needed)
and, unless ``--capacity 0``, ``--holders`` memory holders beside it: Mooncake's standalone client
service (``mooncake_client``), each mounting ``--capacity / --holders`` bytes into the pool. One
holder copies ~5.5 GB/s into engines' shared memory however many call it (H200 host); the master
spreads values over all holders and engines given ``holders`` read each through its own holder, so
N holders load up to N times faster. Values live in holders'
memory, so the pool outlives every engine (engines join with ``global_segment_size=0``: pure
clients). It prints the ``kv_connector_config`` engines use and stops both on Ctrl-C / SIGTERM.
``holder`` runs one more holder (another host's memory) for a running master.
``stats`` prints the master's counters (keys, allocated/total bytes, puts/gets, evictions).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

HOLDER_THREADS = 8  # a holder's service threads: concurrent get/put calls it serves (engines' load_parallel)
_STATS = ("master_key_count", "master_allocated_bytes", "master_total_capacity_bytes", "master_client_count",
          "master_put_start_requests_total", "master_get_replica_list_requests_total",
          "master_exist_key_requests_total", "master_evicted_key_count", "master_evicted_size_bytes",
          "master_remove_requests_total")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """``"4GiB"``, ``"512MB"``, ``"0"``, ``"1073741824"`` -> bytes (``ValueError`` naming the forms)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        n = float(num)
    except ValueError:
        n = -1.0
    if unit not in _UNITS or n < 0:
        raise ValueError(f"size {text!r} is invalid (use bytes or a number with KiB/MiB/GiB/TiB or KB/MB/GB/TB)")
    return int(n * _UNITS[unit])


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = sub.add_parser("master", help="run mooncake_master and a memory holder for the pool (foreground)")
    m.add_argument("--capacity", type=_size_arg, default=1 << 30,
                   help="memory the holder started beside the master gives the pool (default 1GiB; 0: no holder, "
                        "engines' own segments hold the values and leave with them)")
    m.add_argument("--holders", type=int, default=1,
                   help="memory holders sharing --capacity (default 1): a load reads all of them at once; "
                        "holder j serves engines at --holder-port + j, its segment is --segment-port + j")
    m.add_argument("--segment-port", type=int, default=50152,
                   help="the port in the name of holder 0's segment (default 50152; holder j: + j)")
    m.add_argument("--holder-host", default=None,
                   help="address other clients reach the holder's memory at (default: --host, or 127.0.0.1)")
    m.add_argument("--holder-port", type=int, default=50052,
                   help="the holder's client port: engines on this host attach with holder='HOST:PORT' and move "
                        "values through shared memory instead of tcp (default 50052)")
    m.add_argument("--holder-threads", type=int, default=HOLDER_THREADS,
                   help=f"the holder's service threads: each serves one get/put call at a time (one memcpy "
                        f"stream); engines' load_parallel calls run on as many (default {HOLDER_THREADS})")
    m.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this host only; "
                   "0.0.0.0 for engines on other hosts)")
    m.add_argument("--port", type=int, default=50051, help="RPC port engines use as master= (default 50051)")
    m.add_argument("--http-port", type=int, default=8080, help="HTTP metadata server port (default 8080)")
    m.add_argument("--metrics-port", type=int, default=9003, help="metrics/health port (default 9003)")
    m.add_argument("--eviction-high-watermark", type=float, default=0.9,
                   help="pool usage that starts eviction (default 0.9)")
    m.add_argument("--eviction-ratio", type=float, default=0.05, help="share of objects evicted per round")
    m.add_argument("--lease-ttl-ms", type=int, default=None, help="read lease of a value (master default)")
    m.add_argument("extra", nargs="*", help="more mooncake_master flags, after --")
    h = sub.add_parser("holder", help="run one more memory holder for a running master (foreground)")
    h.add_argument("--master", required=True, help="the master's RPC address host:port")
    h.add_argument("--metadata-server", required=True, help="the master's metadata URL (http://host:port/metadata)")
    h.add_argument("--capacity", type=_size_arg, required=True, help="memory this holder gives the pool (e.g. 4GiB)")
    h.add_argument("--host", default="127.0.0.1", help="address other clients reach this holder's memory at")
    h.add_argument("--port", type=int, default=50052,
                   help="client port: engines on this host attach with holder='HOST:PORT' (default 50052)")
    h.add_argument("--segment-port", type=int, default=0,
                   help="the port in this holder's segment name (engines given holders= read its values "
                        "through it; default: the wheel picks one)")
    h.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"), help="transfer protocol (default tcp)")
    h.add_argument("--threads", type=int, default=HOLDER_THREADS,
                   help=f"service threads, each serving one call at a time (default {HOLDER_THREADS})")
    h.add_argument("--metrics", default=None, help="the master's metrics URL: wait until the memory is mounted")
    s = sub.add_parser("stats", help="print the master's counters")
    s.add_argument("--metrics", default="http://127.0.0.1:9003", help="the master's metrics URL")
    s.add_argument("--json", action="store_true", help="all counters as JSON")


def master_command(args: argparse.Namespace, binary: str) -> list[str]:
    cmd = [binary, f"--rpc_address={args.host}", f"--rpc_port={args.port}",
           "--enable_http_metadata_server=true", f"--http_metadata_server_host={args.host}",
           f"--http_metadata_server_port={args.http_port}", f"--metrics_host={args.host}",
           f"--metrics_port={args.metrics_port}", "--enable_metric_reporting=false",
           f"--eviction_high_watermark_ratio={args.eviction_high_watermark}",
           f"--eviction_ratio={args.eviction_ratio}"]
    if args.lease_ttl_ms is not None:
        cmd.append(f"--default_kv_lease_ttl={args.lease_ttl_ms}")
    return cmd + list(args.extra)


def _bad(args: argparse.Namespace) -> str | None:
    if not 1 <= args.holders <= 64:
        return f"--holders={args.holders} is invalid (allowed: 1..64)"
    n = args.holders
    for name in ("port", "http_port", "metrics_port", "holder_port", "segment_port"):
        v = getattr(args, name)
        top = v + n - 1 if name in ("holder_port", "segment_port") else v
        if v < 1 or top > 65535:
            return f"--{name.replace('_', '-')}={v} is invalid (allowed: 1..65535{f' - {n - 1}' if top != v else ''})"
    if not 1 <= args.holder_threads <= 256:
        return f"--holder-threads={args.holder_threads} is invalid (allowed: 1..256)"
    ports = [args.port, args.http_port, args.metrics_port, *range(args.holder_port, args.holder_port + n),
             *range(args.segment_port, args.segment_port + n)]
    if len(set(ports)) < len(ports):
        return (f"--port, --http-port, --metrics-port, --holder-port...+{n - 1} and --segment-port...+{n - 1} "
                "must all differ")
    if (err := _bad_capacity(args.capacity, allow_zero=True)) is not None:
        return err
    if args.capacity and args.capacity // n < _min_segment():
        return (f"--capacity={args.capacity} B is invalid for --holders={n} (each holder needs >= "
                f"{_min_segment() >> 20}MiB)")
    if not 0 < args.eviction_high_watermark <= 1 or not 0 < args.eviction_ratio <= 1:
        return "--eviction-high-watermark and --eviction-ratio must be in (0, 1]"
    return _bad_capacity(args.capacity, allow_zero=True)


def _min_segment() -> int:
    from hwkv.stores.mooncake import MIN_SEGMENT

    return MIN_SEGMENT


def _bad_capacity(capacity: int, allow_zero: bool) -> str | None:
    if (capacity == 0 and allow_zero) or capacity >= _min_segment():
        return None
    return f"--capacity={capacity} B is invalid (need {'0 or ' if allow_zero else ''}>= {_min_segment() >> 20}MiB)"


def _start_holder(master: str, metadata: str, capacity: int, host: str, protocol: str, metrics_url: str | None,
                  port: int = 0, threads: int = HOLDER_THREADS, segment_port: int = 0):
    """A ``mooncake_client`` holder (dies with this command); waits until mounted if ``metrics_url``."""
    from hwkv.stores.mooncake_service import client_binary, die_with_parent, holder_command, pool_capacity, wait_mounted

    binary = client_binary()
    if binary is None:
        raise RuntimeError("mooncake_client (the pool memory holder) is not in the mooncake package")
    before = pool_capacity(metrics_url) if metrics_url else 0.0
    proc = subprocess.Popen(holder_command(binary, master, metadata, capacity, host=host, port=port, protocol=protocol,
                                           threads=threads, segment_port=segment_port),
                            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    if metrics_url:
        try:
            wait_mounted(proc, metrics_url, before, capacity, 30)
        except RuntimeError:
            proc.kill()
            proc.wait()
            raise
    return proc


def run_master(args: argparse.Namespace) -> int:
    from hwkv.stores.mooncake_service import die_with_parent, master_binary, mooncake_available

    ok, why = mooncake_available()
    if not ok:
        print(f"hwkv pool master: {why}", file=sys.stderr)
        return 2
    if (err := _bad(args)) is not None:
        print(f"hwkv pool master: {err}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    # the master dies with this command, even when it is SIGKILLed (no orphan holding the ports)
    proc = subprocess.Popen(master_command(args, master_binary()), stdin=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline and not stopping \
            and not _healthy(f"http://{host}:{args.metrics_port}"):
        time.sleep(0.1)
    if stopping:
        _stop_all([proc])
        return 0
    if proc.poll() is not None:
        print(f"hwkv pool master: mooncake_master exited with {proc.returncode}", file=sys.stderr)
        return 1
    cfg = {"store": "mooncake", "master": f"{host}:{args.port}",
           "metadata_server": f"http://{host}:{args.http_port}/metadata", "protocol": "tcp"}
    metrics_url = f"http://{host}:{args.metrics_port}"
    holders: list[subprocess.Popen] = []
    hhost = args.holder_host or host
    if args.capacity:
        try:
            for j in range(args.holders):
                holders.append(_start_holder(cfg["master"], cfg["metadata_server"], args.capacity // args.holders,
                                             hhost, "tcp", metrics_url, args.holder_port + j, args.holder_threads,
                                             args.segment_port + j))
        except RuntimeError as e:
            print(f"hwkv pool master: {e}", file=sys.stderr)
            _stop_all([*holders, proc])
            return 1
        cfg["global_segment_size"] = 0  # the holders hold the values: engines stay pure clients
    # 256-token values: 1.6-2x faster loads than one-block ones (H200 host, docs/connectors.md); every
    # engine of a pool must use the same chunk size (it is part of the keys), so the printed config says it
    cfg["chunk_size"] = 256
    # 8 clients per load: the best of 1-16 calls / 4-8 clients at the 8B shape on the H200 host (docs/connectors.md)
    if args.holders == 1:
        local = (f"\n  engines on this host add \"holder\": \"127.0.0.1:{args.holder_port}\", \"load_clients\": 8 "
                 "(shared memory, not tcp; a load spread over 8 clients)")
    else:  # every holder's values through that holder: N memcpy streams at once
        hs = {f"127.0.0.1:{args.holder_port + j}": f"{hhost}:{args.segment_port + j}" for j in range(args.holders)}
        local = (f"\n  engines on this host add \"holders\": {json.dumps(hs)} (shared memory, not tcp; a load reads "
                 f"each value through the holder that has it, all {args.holders} at once)")
    held = f" {args.capacity} B held by {args.holders} holder(s)" if holders else ""
    print(f"hwkv pool master: serving{held}; engines join with\n"
          f"  kv_connector='pool', kv_connector_config={json.dumps(cfg)}{local if holders else ''}"
          f"\n  stats: hwkv pool stats --metrics {metrics_url}", flush=True)
    procs = [*holders, proc]
    rc = _wait_any(procs, stopping)
    _stop_all(procs)
    return 0 if stopping else rc


def _wait_any(procs: list[subprocess.Popen], stopping: list[bool]) -> int:
    """Until one of ``procs`` exits (its code), SIGTERM (``stopping``) or Ctrl-C."""
    try:
        while not stopping:
            for p in procs:
                if p.poll() is not None:
                    if p.returncode:
                        print(f"hwkv pool: {p.args[0].rsplit('/', 1)[-1]} exited with {p.returncode}",
                              file=sys.stderr)
                    return p.returncode or 1
            time.sleep(0.2)
    except KeyboardInterrupt:
        stopping.append(True)
    return 0


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:  # the holder first: its segment unmounts while the master still answers
        if p.poll() is None:
            p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_holder(args: argparse.Namespace) -> int:
    if not 1 <= args.threads <= 256:
        print(f"hwkv pool holder: --threads={args.threads} is invalid (allowed: 1..256)", file=sys.stderr)
        return 2
    if (err := _bad_capacity(args.capacity, allow_zero=False)) is not None:
        print(f"hwkv pool holder: {err}", file=sys.stderr)
        return 2
    try:
        proc = _start_holder(args.master, args.metadata_server, args.capacity, args.host, args.protocol, args.metrics,
                             args.port, args.threads, args.segment_port)
    except (RuntimeError, OSError) as e:
        print(f"hwkv pool holder: {e}", file=sys.stderr)
        return 1
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    print(f"hwkv pool holder: {args.capacity} B of {args.host} in the pool of {args.master}; engines on this host "
          f"attach with holder='{args.host}:{args.port}'"
          + (f" (or list it in holders: {args.host}:{args.port} -> {args.host}:{args.segment_port})"
             if args.segment_port else ""), flush=True)
    rc = _wait_any([proc], stopping)
    _stop_all([proc])
    return 0 if stopping else rc


def _healthy(metrics: str) -> bool:
    try:
        with urllib.request.urlopen(f"{metrics}/health", timeout=0.5):
            return True
    except urllib.error.HTTPError as e:
        return e.code == 404  # an older master without /health
    except OSError:
        return False


def metrics(url: str) -> dict[str, float]:
    """The master's Prometheus counters (``RuntimeError`` naming the URL if it does not answer)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=3) as r:
            text = r.read().decode()
    except OSError as e:
        raise RuntimeError(f"no mooncake_master metrics at {url} ({e}); is `hwkv pool master` running?") from e
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name and not line.startswith("#"):
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


def run(args: argparse.Namespace) -> int:
    if args.action == "master":
        return run_master(args)
    if args.action == "holder":
        return run_holder(args)
    try:
        m = metrics(args.metrics)
    except RuntimeError as e:
        print(f"hwkv pool stats: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(m, indent=2, sort_keys=True))
        return 0
    for k in _STATS:
        if k in m:
            print(f"{k:42s} {m[k]:>16,.0f}")
    return 0

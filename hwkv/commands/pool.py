"""``hwkv pool``: run and inspect the Mooncake master behind the global KV pool connector.

    hwkv pool master [--host 127.0.0.1] [--port 50051] [--http-port 8080] [--metrics-port 9003]
    hwkv pool stats [--metrics http://127.0.0.1:9003] [--json]

``master`` runs ``mooncake_master`` in the foreground with an HTTP metadata server (no etcd needed),
prints the ``kv_connector_config`` engines use to join it, and stops it on Ctrl-C / SIGTERM.
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

_STATS = ("master_key_count", "master_allocated_bytes", "master_total_capacity_bytes", "master_client_count",
          "master_put_start_requests_total", "master_get_replica_list_requests_total",
          "master_exist_key_requests_total", "master_evicted_key_count", "master_evicted_size_bytes",
          "master_remove_requests_total")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    m = sub.add_parser("master", help="run mooncake_master for the pool (foreground)")
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
    for name in ("port", "http_port", "metrics_port"):
        v = getattr(args, name)
        if not 0 < v < 65536:
            return f"--{name.replace('_', '-')}={v} is invalid (allowed: 1..65535)"
    if len({args.port, args.http_port, args.metrics_port}) < 3:
        return "--port, --http-port and --metrics-port must differ"
    if not 0 < args.eviction_high_watermark <= 1 or not 0 < args.eviction_ratio <= 1:
        return "--eviction-high-watermark and --eviction-ratio must be in (0, 1]"
    return None


def run_master(args: argparse.Namespace) -> int:
    from hwkv.testing.mooncake import _die_with_parent, master_binary, mooncake_available

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
                            preexec_fn=_die_with_parent)
    stopping = []

    def stop(*_: object) -> None:
        stopping.append(True)
        proc.terminate()

    signal.signal(signal.SIGTERM, stop)
    deadline = time.monotonic() + 15
    while proc.poll() is None and time.monotonic() < deadline and not _healthy(f"http://{host}:{args.metrics_port}"):
        time.sleep(0.1)
    if proc.poll() is not None:
        print(f"hwkv pool master: mooncake_master exited with {proc.returncode}", file=sys.stderr)
        return 1
    cfg = {"store": "mooncake", "master": f"{host}:{args.port}",
           "metadata_server": f"http://{host}:{args.http_port}/metadata", "protocol": "tcp"}
    print(f"hwkv pool master: serving; engines join with\n  kv_connector='pool', kv_connector_config={json.dumps(cfg)}"
          f"\n  stats: hwkv pool stats --metrics http://{host}:{args.metrics_port}", flush=True)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        stop()
    try:
        rc = proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = proc.wait()
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

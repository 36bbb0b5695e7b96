"""``hwkv pool master`` / ``hwkv pool stats``, and an engine that resumes using the pool when the
master it lost comes back on the same address."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import hwkv
from hwkv import SamplingParams
from hwkv.model.tiny import write_tiny_model
from hwkv.testing.mooncake import skip_unless_mooncake
from hwkv.transfer.mooncake import free_port

BS = 16
PROMPT = [(3 * i + 2) % 500 + 1 for i in range(150)]


def _hwkv(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hwkv", *args], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, **kw)


class Master:
    def __init__(self, ports: tuple[int, int, int], *extra: str):
        self.ports, self.holder_port, self.segment_port = ports, free_port(), free_port()
        p, h, m = ports
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read on failure, closed with the object)
        self.proc = _hwkv("pool", "master", "--port", str(p), "--http-port", str(h), "--metrics-port", str(m),
                          "--holder-port", str(self.holder_port), "--segment-port", str(self.segment_port), *extra,
                          stderr=self.log, start_new_session=True)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline, seen = time.monotonic() + 60, ""
        while "hwkv pool stats" not in seen:
            ready = sel.select(max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.proc.stdout.fileno(), 4096).decode() if ready else ""  # unbuffered
            if not chunk:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the CLI and its mooncake_master
                self.stop()
                pytest.fail(f"hwkv pool master did not start: {seen}{self.read_log()}")
            seen += chunk
        self.banner = seen

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode

    def read_log(self) -> str:
        self.log.seek(0)
        return "".join(ln for ln in self.log.read().splitlines(True) if ln[:1] not in "IW")[-3000:]


def _capacity(metrics_port: int) -> int:
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "stats", "--json", "--metrics",
                          f"http://127.0.0.1:{metrics_port}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(json.loads(out.stdout)["master_total_capacity_bytes"])


def test_master_and_stats():
    skip_unless_mooncake()
    ports = (free_port(), free_port(), free_port())
    m = Master(ports, "--capacity", "32MiB")
    try:
        assert f'"master": "127.0.0.1:{ports[0]}"' in m.banner
        assert f'"metadata_server": "http://127.0.0.1:{ports[1]}/metadata"' in m.banner
        assert '"global_segment_size": 0' in m.banner  # the holder holds the values; engines are pure clients
        assert '"chunk_size": 256' in m.banner  # one chunk size for every engine of the pool (part of the keys)
        assert f'"holder": "127.0.0.1:{m.holder_port}", "load_clients": 8' in m.banner  # engines on this host
        out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "stats", "--metrics",
                              f"http://127.0.0.1:{ports[2]}"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "master_key_count" in out.stdout
        assert _capacity(ports[2]) == 32 << 20
        # one more holder (another host's memory, here this one's) joins the running master
        holder = _hwkv("pool", "holder", "--master", f"127.0.0.1:{ports[0]}", "--metadata-server",
                       f"http://127.0.0.1:{ports[1]}/metadata", "--capacity", "16MiB", "--port", str(free_port()),
                       "--metrics", f"http://127.0.0.1:{ports[2]}", stderr=subprocess.DEVNULL)
        try:
            assert "hwkv pool holder: 16777216 B" in holder.stdout.readline()
            assert _capacity(ports[2]) == 48 << 20
        finally:
            holder.send_signal(signal.SIGTERM)
            assert holder.wait(20) == 0
            holder.stdout.close()
    finally:
        assert m.stop() == 0
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "stats", "--metrics", f"http://127.0.0.1:{ports[2]}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "is `hwkv pool master` running?" in out.stderr


def test_master_with_several_holders():
    """``--holders 2``: the capacity split over two holders, and the banner's ``holders`` names each
    holder's attach address and segment (engines read each value through the holder that has it)."""
    skip_unless_mooncake()
    ports = (free_port(), free_port(), free_port())
    m = Master(ports, "--capacity", "64MiB", "--holders", "2")
    try:
        assert _capacity(ports[2]) == 64 << 20
        hs = {f"127.0.0.1:{m.holder_port + j}": f"127.0.0.1:{m.segment_port + j}" for j in range(2)}
        assert f'"holders": {json.dumps(hs)}' in m.banner and "by 2 holder(s)" in m.banner
    finally:
        assert m.stop() == 0


def test_bad_master_arguments():
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "master", "--port", "7", "--http-port", "7"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--port, --http-port, --metrics-port, --holder-port...+0 and --segment-port...+0 " \
        "must all differ" in out.stderr
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "master", "--holders", "4", "--capacity", "32MiB"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--capacity=33554432 B is invalid for --holders=4 (each holder needs >= 16MiB)" \
        in out.stderr
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "master", "--holders", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--holders=0 is invalid (allowed: 1..64)" in out.stderr
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "master", "--capacity", "1MiB"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--capacity=1048576 B is invalid (need 0 or >= 16MiB)" in out.stderr
    out = subprocess.run([sys.executable, "-m", "hwkv", "pool", "master", "--capacity", "lots"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "size 'lots' is invalid" in out.stderr


def test_engine_resumes_when_the_master_returns(tmp_path):
    skip_unless_mooncake()
    torch.set_num_threads(1)
    model = str(write_tiny_model(tmp_path / "m", seed=0))
    sp = SamplingParams(max_tokens=6, temperature=0)
    want = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=BS).generate(
        [PROMPT], sp, use_tqdm=False)[0].token_ids
    ports = (free_port(), free_port(), free_port())
    m = Master(ports)
    cfg = dict(store="mooncake", master=f"127.0.0.1:{ports[0]}", metadata_server=f"http://127.0.0.1:{ports[1]}/metadata",
               global_segment_size=32 << 20, retry_s=0.5, timeout_s=2.0, lookup_timeout_s=0.5)
    e = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=BS, enable_prefix_caching=False,
                    kv_connector="pool", kv_connector_config=cfg)
    conn = e.scheduler.connector

    def run() -> dict:
        assert e.generate([PROMPT], sp, use_tqdm=False)[0].token_ids == want
        deadline = time.monotonic() + 20
        while conn.has_pending_transfers():
            assert time.monotonic() < deadline
            e.step()
            time.sleep(0.01)
        return e.stats()["kv_connector"]

    try:
        assert run()["stored_chunks"] == 9
        assert run()["external_hit_tokens"] == 9 * BS
        m.stop()  # the pool is gone: recompute
        st = run()
        assert st["external_hit_tokens"] == 9 * BS
        m = Master(ports)  # back, empty, on the same address
        deadline = time.monotonic() + 30
        while run()["external_hit_tokens"] == 9 * BS:  # reconnects, puts again, then hits
            assert time.monotonic() < deadline, e.stats()["kv_connector"]
            time.sleep(0.2)
        assert e.stats()["kv_connector"]["store_connects"] >= 2
    finally:
        conn.shutdown()
        m.stop()


def test_bench_pool_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hwkv", "bench", "pool", "--prompt-len", "80", "--repeats", "1",
                          "--lookup-iters", "3", "--workdir", str(tmp_path), "--out-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    (res,) = tmp_path.glob("pool-*.json")
    r = json.loads(res.read_text())
    assert r["loaded_tokens"] == 64 and r["load_failures"] == 0 and r["ttft_pool_ms"] > 0 and r["get_GBps"] > 0


def test_engine_started_without_its_master_joins_when_it_answers(tmp_path):
    skip_unless_mooncake()
    torch.set_num_threads(1)
    model = str(write_tiny_model(tmp_path / "m", seed=0))
    sp = SamplingParams(max_tokens=4, temperature=0)
    want = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=BS).generate(
        [PROMPT], sp, use_tqdm=False)[0].token_ids
    ports = (free_port(), free_port(), free_port())
    cfg = dict(store="mooncake", master=f"127.0.0.1:{ports[0]}", metadata_server=f"http://127.0.0.1:{ports[1]}/metadata",
               global_segment_size=32 << 20, retry_s=0.3, timeout_s=2.0, lookup_timeout_s=0.5)
    e = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=BS, enable_prefix_caching=False,
                    kv_connector="pool", kv_connector_config=cfg)  # no master yet: serves without the pool
    conn, m = e.scheduler.connector, None
    try:
        assert e.generate([PROMPT], sp, use_tqdm=False)[0].token_ids == want
        st = e.stats()["kv_connector"]
        assert not st["store_up"] and f"127.0.0.1:{ports[0]}" in st["store_last_error"]
        m = Master(ports)
        deadline = time.monotonic() + 30
        while e.stats()["kv_connector"]["external_hit_tokens"] == 0:
            assert time.monotonic() < deadline, e.stats()["kv_connector"]
            assert e.generate([PROMPT], sp, use_tqdm=False)[0].token_ids == want
            time.sleep(0.2)
    finally:
        conn.shutdown()
        if m is not None:
            m.stop()


def test_master_dies_with_a_killed_cli():
    skip_unless_mooncake()
    ports = (free_port(), free_port(), free_port())
    m = Master(ports)
    m.proc.kill()  # SIGKILL: no handler runs; the master must not be orphaned holding the ports
    m.stop()
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", ports[0]), timeout=0.2):
            assert time.monotonic() < deadline, "mooncake_master outlived its hwkv pool master"
            time.sleep(0.1)
            continue
        break

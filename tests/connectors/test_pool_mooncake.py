"""The `pool` connector on a real mooncake_master (127.0.0.1, started and stopped here): two engines
in two processes share a prefix; a killed master means recompute with identical tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import hwkv
from hwkv import SamplingParams
from hwkv.model.tiny import write_tiny_model
from hwkv.stores.mooncake_service import mooncake_master
from hwkv.testing.mooncake import skip_unless_mooncake

BS = 16
PROMPT = [(5 * i + 1) % 500 + 1 for i in range(150)]  # 9 full blocks before the last token

CHILD = r"""
import json, sys, time
import torch
import hwkv
from hwkv import SamplingParams
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
model, prompt = cfg.pop("model"), cfg.pop("prompt")
e = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=16, kv_connector="pool",
                kv_connector_config=cfg)
toks = e.generate([prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids
conn, deadline = e.scheduler.connector, time.monotonic() + 20
while conn.has_pending_transfers() and time.monotonic() < deadline:
    e.step()
    time.sleep(0.01)
st = e.stats()["kv_connector"]
free = e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
print(json.dumps({"tokens": toks, "free": free,
                  "stats": {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool))}}), flush=True)
sys.stdin.readline()  # its segment holds pool values: stay until told to go
conn.shutdown()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("pool_mc") / "m", seed=0))


@pytest.fixture(scope="module")
def expected(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS)
    return e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids


def _cfg(m, **kw):
    return dict(store="mooncake", master=m.master, metadata_server=m.metadata_server, protocol="tcp",
                global_segment_size=32 << 20, **kw)


class Child:
    """An engine in its own process; ``result()`` waits (bounded) for its JSON line."""

    def __init__(self, cfg: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})

    def result(self, timeout_s: float = 120) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            self.stop()
            pytest.fail(f"engine process gave no result in {timeout_s} s")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            pytest.fail(f"engine process failed:\n{self.proc.stderr.read()[-3000:]}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def test_two_processes_share_a_prefix(model_dir, expected):
    skip_unless_mooncake()
    with mooncake_master() as m:
        a = Child({"model": model_dir, "prompt": PROMPT, **_cfg(m)})
        try:
            ra = a.result()
            assert ra["tokens"] == expected and ra["free"]
            assert ra["stats"]["stored_chunks"] == 9 and ra["stats"]["external_hit_tokens"] == 0
            b = Child({"model": model_dir, "prompt": PROMPT, **_cfg(m)})
            try:
                rb = b.result()
            finally:
                b.stop()
            assert rb["tokens"] == expected and rb["free"]
            assert rb["stats"]["external_hit_tokens"] == 9 * BS and rb["stats"]["load_failures"] == 0
            assert rb["stats"]["loaded_bytes"] == ra["stats"]["stored_bytes"] > 0
            assert rb["stats"]["stored_bytes"] == 0  # the prefix it loaded is not put again
        finally:
            a.stop()
        assert a.proc.returncode == 0 and b.proc.returncode == 0


def _settle(e: hwkv.Engine, timeout_s: float = 20.0) -> dict:
    conn, deadline = e.scheduler.connector, time.monotonic() + timeout_s
    while conn.has_pending_transfers():
        assert time.monotonic() < deadline, "pool transfers did not complete"
        e.step()
        time.sleep(0.01)
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
    return e.stats()["kv_connector"]


def test_master_killed_mid_run_recomputes(model_dir, expected):
    skip_unless_mooncake()
    sp = SamplingParams(max_tokens=6, temperature=0)
    with mooncake_master() as m:
        # no local prefix cache: every repeat of the prompt asks the pool
        e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, enable_prefix_caching=False,
                        kv_connector="pool", kv_connector_config=_cfg(m, timeout_s=2.0, lookup_timeout_s=0.5))
        try:
            assert e.generate([PROMPT], sp, use_tqdm=False)[0].token_ids == expected
            assert _settle(e)["stored_chunks"] == 9
            assert e.generate([PROMPT], sp, use_tqdm=False)[0].token_ids == expected
            assert _settle(e)["external_hit_tokens"] == 9 * BS  # a round trip through Mooncake
            os.kill(m.pid, signal.SIGKILL)
            t0 = time.monotonic()
            for p in (PROMPT, PROMPT[::-1], PROMPT):
                want = expected if p is PROMPT else None
                got = e.generate([p], sp, use_tqdm=False)[0].token_ids
                assert want is None or got == want
            assert time.monotonic() - t0 < 30  # seconds, not minutes (timeouts of 0.5-2 s)
            st = _settle(e)
            assert st["external_hit_tokens"] == 9 * BS  # nothing loaded after the kill
        finally:
            e.scheduler.connector.shutdown()


def test_kv_cache_groups_through_a_real_master(hybrid_dir):
    """A Gemma-3-shaped model (a full and a window-16 group) on a real mooncake_master: a second
    engine loads the first one's chunks of both groups (the window group's window only) and gives the
    plain engine's tokens; every pool of every group whole at the end."""
    skip_unless_mooncake()
    from .conftest import assert_no_leak

    prompt = PROMPT[:4 * BS + 5]
    sp = SamplingParams(max_tokens=6, temperature=0)
    plain = hwkv.Engine(hybrid_dir, num_kv_blocks=64, max_model_len=128, block_size=BS, enable_prefix_caching=False)
    want = plain.generate([prompt], sp, use_tqdm=False)[0].token_ids
    with mooncake_master() as m:
        a, b = (hwkv.Engine(hybrid_dir, num_kv_blocks=32, max_model_len=128, block_size=BS, kv_connector="pool",
                            kv_connector_config=_cfg(m)) for _ in range(2))
        try:
            assert [g.window for g in b.config.kv_groups] == [None, 16]
            assert a.generate([prompt], sp, use_tqdm=False)[0].token_ids == want
            sa = _settle(a)
            assert b.generate([prompt], sp, use_tqdm=False)[0].token_ids == want
            sb = _settle(b)
            assert sb["external_hit_tokens"] == 4 * BS and sb["load_failures"] == 0
            # a chunk of a group is that group's layers: the window group (2 layers) twice the full one's (1)
            per_layer = a.kv_cache.caches[0].spec.bytes_per_block
            assert sa["stored_bytes"] == 4 * per_layer * 3 and sa["stored_chunks"] == 8  # 4 chunks of each group
            assert sb["loaded_bytes"] == 4 * per_layer + 1 * 2 * per_layer  # the window group: its last chunk
            for e in (a, b):
                assert_no_leak(e)
        finally:
            _close_all(a, b)


def _close_all(*engines: hwkv.Engine) -> None:
    for e in engines:
        e.scheduler.connector.shutdown()

"""The pool connector's accelerator path reproduced on CPU: KV through host staging (as when the KV
cache is device memory) and device events that complete after the host issued the work. Failures
inside the transfer threads must end their jobs (never a dead thread, never a leaked pin) and say why."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import pytest

import hwkv
from hwkv import SamplingParams
from hwkv.bench import pool as pool_bench
from hwkv.connectors.pool import transfer as pool_transfer
from hwkv.connectors.pool.store import drop_embedded
from hwkv.model.tiny import write_tiny_model

from .test_pool import _settle

BS = 16
PROMPT = [(5 * i + 2) % 400 + 1 for i in range(150)]  # 9 full blocks before the last token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("pool-accel") / "m", seed=0))


@pytest.fixture
def store_name(request):
    name = f"test-accel-{request.node.name}"
    yield name
    drop_embedded(name)


class _LateEvent:
    """A device event that completes ``delay_s`` after it was recorded (a GPU's queued work)."""

    def __init__(self, ev: Any, delay_s: float):
        self.ev, self.delay_s, self.t = ev, delay_s, 0.0

    def record(self, *stream: Any) -> None:
        self.ev.record(*stream)
        self.t = time.monotonic()

    def query(self) -> bool:
        return time.monotonic() >= self.t + self.delay_s

    def synchronize(self) -> None:
        self.ev.synchronize()
        time.sleep(max(0.0, self.t + self.delay_s - time.monotonic()))


class _LateDevice:
    def __init__(self, dev: Any, delay_s: float):
        self._dev, self._delay = dev, delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dev, name)

    def new_event(self, *a: Any, **k: Any) -> _LateEvent:
        return _LateEvent(self._dev.new_event(*a, **k), self._delay)


@pytest.fixture
def accelerator_like(monkeypatch):
    """Staging instead of zero-copy, and late events, in every engine built meanwhile."""
    from hwkv.connectors.pool import PoolConnector

    monkeypatch.setattr(pool_transfer, "host_addressable", lambda kv: False)
    orig = PoolConnector.bind_device
    monkeypatch.setattr(PoolConnector, "bind_device", lambda self, dev: orig(self, _LateDevice(dev, 0.03)))


def _engine(model_dir: str, store_name: str) -> hwkv.Engine:
    return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, async_scheduling=True,
                       kv_connector="pool", kv_connector_config=dict(store_name=store_name, staging_bytes=1))


def _run(e: hwkv.Engine, prompt: list[int] = PROMPT) -> list[int]:
    return e.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0].token_ids


def test_staged_late_events_second_engine_hits(model_dir, store_name, accelerator_like):
    a, b = _engine(model_dir, store_name), _engine(model_dir, store_name)
    try:
        assert not a.scheduler.connector.worker.transfer.direct
        want = _run(a)
        assert _settle(a)["stored_chunks"] == 9
        assert _run(b) == want
        st = _settle(b)
        assert st["external_hit_tokens"] == 9 * BS and st["load_failures"] == 0 and st["last_load_error"] == ""
    finally:
        for e in (a, b):
            e.scheduler.connector.shutdown()


def test_a_failing_staging_copy_ends_the_jobs_and_says_why(model_dir, store_name, accelerator_like, monkeypatch):
    """Before: an exception other than StoreError killed the sending thread (pins held forever, the
    engine never idle) and a failed load's reason was dropped."""
    def broken(*a: Any, **k: Any) -> None:
        raise RuntimeError("injected: copy engine fault")

    a, b = _engine(model_dir, store_name), _engine(model_dir, store_name)
    try:
        want = _run(a)
        _settle(a)
        with monkeypatch.context() as m:
            m.setattr(pool_transfer, "copy_block_pairs", broken)
            other = _engine(model_dir, store_name)
            try:
                _run(other, PROMPT[::-1])  # not in the pool yet: its puts copy to staging
                st = _settle(other)  # the puts end (failed) and release their pins
                assert st["failed_stores"] >= 1 and st["stored_chunks"] == 0
                assert "RuntimeError: injected: copy engine fault" in st["last_store_error"]
            finally:
                other.scheduler.connector.shutdown()
            assert _run(b) == want  # the load's staging -> device copy fails: recompute, same tokens
            st = _settle(b)
            assert st["load_failures"] == 1 and st["external_hit_tokens"] == 0
            assert "RuntimeError: injected: copy engine fault" in st["last_load_error"]
    finally:
        for e in (a, b):
            e.scheduler.connector.shutdown()


def test_bench_waits_for_the_puts_and_reports_it(model_dir, tmp_path, accelerator_like):
    p = argparse.ArgumentParser()
    pool_bench.add_arguments(p)
    args = p.parse_args(["--model", model_dir, "--prompt-len", "80", "--repeats", "1", "--lookup-iters", "2",
                         "--out-dir", str(tmp_path), "--engine-args", '{"async_scheduling": true}'])
    assert pool_bench.run(args) == 0
    (res,) = tmp_path.glob("pool-*.json")
    r = json.loads(res.read_text())
    assert r["loaded_tokens"] == 64 and r["load_failures"] == 0 and r["store_wait_ms"] >= 0


def test_a_load_over_several_clients_lands_from_one_thread(model_dir, store_name, accelerator_like, monkeypatch):
    """``load_clients``: the clients' threads read and hand their pieces to the receiving thread, which
    queues every copy to the device (one thread launching); a copy that fails there fails the load
    with its reason - the request recomputes to the same tokens, nothing stays pinned."""
    import threading

    def engine(**cfg: Any) -> hwkv.Engine:
        return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, async_scheduling=True,
                           kv_connector="pool", kv_connector_config=dict(store_name=store_name, **cfg))

    a, b, c = engine(staging_bytes=1), engine(staging_bytes=1 << 20, load_clients=3, load_parallel=1), \
        engine(staging_bytes=1 << 20, load_clients=3, load_parallel=1)
    try:
        want = _run(a)
        _settle(a)
        tb = b.scheduler.connector.worker.transfer
        assert len(tb._lanes) == 2
        landers: set[str] = set()
        orig = pool_transfer.copy_block_pairs

        def traced(*args: Any, **kw: Any) -> None:
            landers.add(threading.current_thread().name)
            orig(*args, **kw)

        with monkeypatch.context() as m:
            m.setattr(pool_transfer, "copy_block_pairs", traced)
            assert _run(b) == want
            st = _settle(b)
        assert st["external_hit_tokens"] == 9 * BS and st["load_failures"] == 0
        assert landers == {"hwkv-pool-recv"}  # three clients read; one thread queued every copy

        def broken(*args: Any, **kw: Any) -> None:
            raise RuntimeError("injected: copy engine fault")

        with monkeypatch.context() as m:
            m.setattr(pool_transfer, "copy_block_pairs", broken)
            assert _run(c) == want  # recomputed
            st = _settle(c)  # asserts every block and pin is back
        assert st["load_failures"] == 1 and "RuntimeError: injected: copy engine fault" in st["last_load_error"]
    finally:
        for e in (a, b, c):
            e.scheduler.connector.shutdown()

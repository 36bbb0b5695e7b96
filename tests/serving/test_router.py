"""Cache-aware routing: two `hwkv serve` processes publishing KV events over real ZMQ sockets behind
`hwkv proxy --instances` (the router), driven by the official openai client. Requests sharing a
prefix go to the instance that caches it (the events say so, or the router's own routing while the
prefill runs); a dead instance is skipped; no process is left behind. The policy itself (load
balance, fallbacks) is checked on the Router object with indexes filled by hand."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from hwkv.bench.common import stop_process, wait_http
from hwkv.model.tiny import write_tiny_model
from hwkv.serving.router import Router

_UTILS = Path(__file__).parent / "server_utils.py"
_spec = importlib.util.spec_from_file_location("server_utils", _UTILS)
server_utils = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(server_utils)  # type: ignore[union-attr]
Server, free_port = server_utils.Server, server_utils.free_port

ENGINE = ["--num-kv-blocks", "96", "--block-size", "16", "--max-model-len", "512", "--seed", "0",
          "--served-model-name", "tiny"]


class RouterProc:
    def __init__(self, model: Path, urls: list[str], events: list[str], replays: list[str], *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="hwkv-router-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "hwkv", "proxy", "--instances", ",".join(urls), "--kv-events", ",".join(events),
               "--kv-events-replay", ",".join(replays), "--model", str(model), "--port", str(self.port),
               "--timeout", "30", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        if not wait_http(self.proc, self.url + "/v1/models", 60):
            self.stop()
            raise RuntimeError(f"router did not start:\n{Path(self.log.name).read_text()}")

    def stats(self) -> dict:
        return httpx.get(self.url + "/router/stats", timeout=10).json()

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("router") / "tiny", seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def cluster(tiny):
    started: list = []
    try:
        servers, events, replays = [], [], []
        for _ in range(2):
            ev, rp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            servers.append(Server(tiny, *ENGINE, "--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rp,
                                  timeout=120))
            started.append(servers[-1])
            events.append(ev)
            replays.append(rp)
        router = RouterProc(tiny, [s.url for s in servers], events, replays)
        started.append(router)
        yield servers, router
    finally:
        errors = []
        for s in reversed(started):
            if not s.log.closed:  # the dead-instance test stopped one already
                try:
                    s.stop()
                except Exception as e:  # stop the others all the same
                    errors.append(e)
        assert not errors, errors
    for s in started:
        assert s.proc.poll() is not None  # nothing left running


def _wait_cached(router: RouterProc, url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        inst = next(x for x in router.stats()["instances"] if x["url"] == url)
        if inst["gpu_blocks"] > 0:
            return
        assert time.monotonic() < deadline, f"no KV events from {url} within {timeout_s} s: {router.stats()}"
        time.sleep(0.1)


def test_shared_prefixes_follow_their_cache(cluster):
    import openai

    servers, router = cluster
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=60, max_retries=0)
    tenants = ["You are a helpful assistant for the tax office. " * 8, "Translate everything into French, please. " * 8]
    first = {}
    for t, system in enumerate(tenants):
        r = client.completions.with_raw_response.create(model="tiny", prompt=system + "Question 0?", max_tokens=2,
                                                        temperature=0)
        first[t] = r.headers["x-hwkv-instance"]
        _wait_cached(router, first[t])
    for q in range(1, 4):
        for t, system in enumerate(tenants):
            r = client.completions.with_raw_response.create(model="tiny", prompt=system + f"Question {q}?",
                                                            max_tokens=2, temperature=0)
            assert r.headers["x-hwkv-instance"] == first[t], (t, q, router.stats())
            assert r.parse().choices[0].text is not None
    st = router.stats()
    assert st["cache_routed"] >= 6 and st["matched_fraction"] > 0.5, st
    # chat and streaming are routed and passed through too
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": tenants[0]}],
                                            max_tokens=3, temperature=0, stream=True)
    assert sum(1 for _ in stream) >= 2
    assert all(x["inflight"] == 0 for x in router.stats()["instances"])


def test_requests_arriving_together_share_one_prefill(cluster):
    """A burst of one new prefix: before any event, the router's own routing keeps them together."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    servers, router = cluster
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=60, max_retries=0)
    system = "A brand new tenant with its own long system prompt. " * 8

    def ask(i: int) -> str:
        r = client.completions.with_raw_response.create(model="tiny", prompt=system + f"Item {i}", max_tokens=2,
                                                        temperature=0)
        return r.headers["x-hwkv-instance"]

    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(ask, range(4)))
    assert len(set(got)) == 1, got


def test_a_dead_instance_is_skipped(cluster, tiny):
    import openai

    servers, router = cluster
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", timeout=60, max_retries=0)
    system = "Yet another tenant, whose prefix lives on the instance that will die. " * 6
    r = client.completions.with_raw_response.create(model="tiny", prompt=system, max_tokens=2, temperature=0)
    home = r.headers["x-hwkv-instance"]
    _wait_cached(router, home)
    victim = next(s for s in servers if s.url == home)
    victim.stop()
    r = client.completions.with_raw_response.create(model="tiny", prompt=system + "again", max_tokens=2,
                                                    temperature=0)
    assert r.http_response.status_code == 200 and r.headers["x-hwkv-instance"] != home
    assert router.stats()["unreachable"] >= 1


# ---- the policy, on indexes filled by hand -------------------------------------------------------
class _Sub:
    def __init__(self, gpu=(), cpu=()):
        from hwkv.engine.kv_events import KVEventIndex

        self.index = KVEventIndex()
        self.index.media = {"GPU": set(gpu), "CPU": set(cpu)}
        self.index.block_size = {"GPU": 16}
        self.next_seq = 1


def _router(n: int, **kw) -> Router:
    r = Router([f"http://127.0.0.1:{i}" for i in range(n)], [f"tcp://127.0.0.1:{i}" for i in range(n)], **kw)
    for inst in r.instances:
        inst.sub = _Sub()
    return r


def test_policy_longest_prefix_balance_and_fallbacks():
    h = [bytes([i]) * 32 for i in range(8)]
    r = _router(3, balance_abs=2)
    r.instances[0].sub = _Sub(gpu=h[:2])
    r.instances[1].sub = _Sub(gpu=h[:5])
    r.instances[2].sub = _Sub(gpu=h[:1], cpu=h[1:8])  # a long host-tier prefix: 1 + 7 * 0.5
    assert r.choose(h) == (1, 5.0)
    r.instances[1].sub = _Sub(gpu=h[:4])
    assert r.choose(h) == (2, 4.5)
    r.instances[2].inflight = 3  # more than balance_abs above the least loaded: not a candidate
    assert r.choose(h) == (1, 4.0)
    assert r.choose([bytes([9]) * 32])[1] == 0.0  # nothing cached anywhere: least loaded
    r.instances[2].inflight = 0
    r.instances[0].inflight = r.instances[1].inflight = 1
    assert r.choose([bytes([9]) * 32]) == (2, 0.0)
    rr = _router(3, policy="round_robin")
    assert [rr.choose(h)[0] for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r.instances[2].down_until = time.monotonic() + 60  # unreachable a moment ago: skipped
    assert r.choose([bytes([9]) * 32])[0] != 2


def test_policy_load_weight_trades_the_prefix_against_queued_work():
    h = [bytes([i]) * 32 for i in range(10)]
    r = _router(2, load_weight=1.0)
    r.instances[0].sub = _Sub(gpu=h[:8])  # 2 blocks to compute there
    assert r.choose(h) == (0, 8.0)  # nothing queued anywhere: the prefix wins
    work = r.routed(0, [bytes([20 + i]) * 32 for i in range(9)], 0.0)  # a 9-block miss queued on 0
    assert work == 9.0 and r.instances[0].queued == 9.0 and r.instances[0].inflight == 1
    assert r.choose(h) == (1, 0.0)  # 2 + 9 queued > 10 to compute on the idle one
    r.load_weight = 0.5
    assert r.choose(h) == (0, 8.0)  # 2 + 4.5 < 10
    r.released(0, work)
    assert r.instances[0].queued == 0.0 and r.instances[0].inflight == 0
    assert _router(2).choose(h)[1] == 0.0 and r.summary()["load_weight"] == 0.5
    r.load_weight = 1.0
    r.instances[1].sub = _Sub(gpu=h[:8])
    r.instances[1].queued = 1.0
    assert r.choose(h) == (0, 8.0)  # equal prefixes: the less queued
    with pytest.raises(ValueError, match="load_weight=-1 is invalid"):
        _router(2, load_weight=-1)


def test_policy_routed_requests_count_as_cached_until_events_come():
    h = [bytes([i]) * 32 for i in range(4)]
    r = _router(2, predict_ttl_s=0.2)
    i, score = r.choose(h)
    assert score == 0.0
    r.routed(i, h, score)
    assert r.choose(h) == (i, 4.0)  # follows the first, whose prefill has not reported yet
    time.sleep(0.25)
    assert r.choose(h)[1] == 0.0  # expired: only events count now


def test_bad_configuration():
    with pytest.raises(ValueError, match="needs each instance's KV events endpoint"):
        Router(["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="1 kv events endpoints for 2 instances"):
        Router(["http://127.0.0.1:1", "http://127.0.0.1:2"], ["tcp://127.0.0.1:3"])
    with pytest.raises(ValueError, match="policy 'random' is invalid"):
        Router(["http://127.0.0.1:1"], policy="random")
    assert Router(["http://127.0.0.1:1"], policy="least_loaded").choose([]) == (0, 0.0)

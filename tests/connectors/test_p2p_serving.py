"""Disaggregated serving end to end on the CPU backend: `hwkv serve` producer and consumer processes
behind `hwkv proxy`, in pull and push mode, give exactly the tokens of one engine (completions,
chat, streaming, salted, concurrent requests on a consumer too small to hold them all); a dead
prefill server is a clear 503, a producer that dies after prefill makes the consumer recompute."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import hwkv
from hwkv.bench.common import stop_process, wait_http
from hwkv.model.tiny import write_tiny_model
from hwkv.testing.mooncake import skip_unless_mooncake

skip_unless_mooncake(allow_module_level=True)

_UTILS = Path(__file__).parents[1] / "serving" / "server_utils.py"
_spec = importlib.util.spec_from_file_location("server_utils", _UTILS)
server_utils = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(server_utils)  # type: ignore[union-attr]
Server, free_port = server_utils.Server, server_utils.free_port

ENGINE = ["--num-kv-blocks", "64", "--block-size", "16", "--max-model-len", "512", "--seed", "0"]
PROMPTS = ["Hello, world! How are you", "The quick brown fox jumps over the lazy dog " * 6, "Once upon a time"]


def connector(role: str, mode: str, **kw) -> list[str]:
    return ["--kv-connector", "p2p", "--kv-connector-config",
            json.dumps({"role": role, "mode": mode, "transfer_timeout_s": 3.0, "hold_timeout_s": 30.0, **kw})]


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], *args: str, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="hwkv-proxy-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [sys.executable, "-m", "hwkv", "proxy", "--prefill", ",".join(prefill), "--decode", ",".join(decode),
               "--port", str(self.port), "--timeout", "30", "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        if not wait_http(self.proc, self.url + "/v1/models", timeout):
            self.stop()
            raise RuntimeError(f"proxy did not start:\n{Path(self.log.name).read_text()}")

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()
        os.unlink(self.log.name)


def counter(url: str, name: str) -> float:
    """A p2p connector counter from the server's Prometheus metrics."""
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"hwkv_connector_{name}_total{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no hwkv_connector_{name}_total at {url}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("p2p") / "tiny", seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def local(tiny):
    return hwkv.Engine(tiny, backend="cpu", num_kv_blocks=64, block_size=16, max_model_len=512, seed=0)


def want(local: hwkv.Engine, prompt: str, n: int = 8, salt: str | None = None) -> list[int]:
    sp = hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, cache_salt=salt)
    return local.generate([prompt], sp, use_tqdm=False)[0].token_ids


def complete(url: str, prompt: str, n: int = 8, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module", params=["pull", "push", "layerwise"])
def cluster(request, tiny):
    mode, extra, proxy_args = request.param, {}, []
    if mode == "layerwise":  # consumer first: the proxy names the producer's side channel to the consumer
        port = free_port()
        mode, extra = "push", {"layerwise": True, "side_channel_port": port}
        proxy_args = ["--layerwise", "--prefill-side-channel", f"127.0.0.1:{port}"]
    started = []
    try:
        p = Server(tiny, *ENGINE, "--served-model-name", "tiny", *connector("producer", mode, **extra), timeout=120)
        started.append(p)
        # push: a consumer too small for the concurrent batch below (preemption while waiting for KV)
        blocks = ["--num-kv-blocks", "24", "--max-model-len", "384"] if request.param == "push" else []
        d = Server(tiny, *ENGINE, *blocks, "--served-model-name", "tiny", *connector("consumer", mode), timeout=120)
        started.append(d)
        px = Proxy([p.url], [d.url], *proxy_args)
        started.append(px)
        yield request.param, p, d, px
    finally:
        for s in reversed(started):
            s.stop()
        if len(started) > 1:  # SIGTERM: the consumer shut down gracefully (connector threads included)
            assert started[1].proc.returncode == 0


def test_completions_token_identical_to_one_engine(cluster, local):
    mode, p, d, px = cluster
    for prompt in PROMPTS:
        got = complete(px.url, prompt)
        assert got["choices"][0]["token_ids"] == want(local, prompt), prompt
        assert "kv_transfer_params" not in got  # a consumer returns none
    assert counter(d.url, "transfers") >= len(PROMPTS) and counter(d.url, "loaded_bytes") > 0
    assert counter(d.url, "failed_transfers") == 0


def test_proxy_errors_are_clear(cluster):
    mode, p, d, px = cluster
    if mode != "pull":
        pytest.skip("once is enough")
    r = httpx.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1}, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.text  # a client error passes through as it came
    wrong = Proxy([d.url], [d.url])  # a "prefill" server without a producer connector
    try:
        r = httpx.post(wrong.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 502 and "returned no kv_transfer_params" in r.json()["error"]["message"]
    finally:
        wrong.stop()


def test_prefill_server_returns_kv_transfer_params(cluster):
    mode, p, d, px = cluster
    got = complete(p.url, PROMPTS[0], n=1, kv_transfer_params={"do_remote_decode": True})
    params = got["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_block_ids"]
    assert params["mode"] == ("push" if mode == "layerwise" else mode)
    # unclaimed: the producer frees them after hold_timeout_s (tested in-process)


def test_streaming_and_chat_pass_through(cluster, local):
    mode, p, d, px = cluster
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    ids = []
    with httpx.stream("POST", px.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    assert ids == want(local, PROMPTS[1])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    direct = httpx.post(p.url + "/v1/chat/completions", json=chat, timeout=60).json()
    via = httpx.post(px.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]


def test_salted_and_concurrent_requests(cluster, local):
    mode, p, d, px = cluster
    assert complete(px.url, PROMPTS[1], cache_salt="t1")["choices"][0]["token_ids"] == \
        want(local, PROMPTS[1], salt="t1")
    before = counter(d.url, "transfers")
    prompts = [f"request {i}: " + "lorem ipsum dolor sit amet " * (3 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda q: complete(px.url, q, n=12)["choices"][0]["token_ids"], prompts))
    assert got == [want(local, q, n=12) for q in prompts]
    assert counter(d.url, "transfers") - before == len(prompts) and counter(d.url, "failed_transfers") == 0
    if mode == "push":  # its consumer's 24 blocks cannot hold the batch: requests wait or are preempted
        assert sum(-(-(len(local.tokenizer.encode(q)) + 12) // 16) for q in prompts) > 24


def test_dead_producer_is_a_clear_error_or_a_recompute(cluster, local):
    mode, p, d, px = cluster
    params = complete(p.url, PROMPTS[2], n=1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    p.proc.kill()  # the producer dies holding the blocks the consumer is about to fetch
    p.proc.wait(10)
    t0 = time.monotonic()
    got = complete(d.url, PROMPTS[2], kv_transfer_params=params)  # the consumer recomputes
    assert got["choices"][0]["token_ids"] == want(local, PROMPTS[2])
    # the side channel finds the dead producer in about a second, not its 3 s call timeout
    assert time.monotonic() - t0 < 2.5
    if mode == "layerwise":  # the decode request goes out first: its server recomputes
        assert complete(px.url, PROMPTS[0])["choices"][0]["token_ids"] == want(local, PROMPTS[0])
    else:
        r = httpx.post(px.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "prefill server" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 30

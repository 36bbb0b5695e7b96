"""`hwkv serve` as a real process, driven by the official `openai` client: completions and chat
equal Engine.generate, streaming equals non-streaming, 64 concurrent streams, a disconnect frees
its request, bad input → 400 naming the field, /metrics parses, API key, a dead core → clear errors."""

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import Server, alive

import hwkv

pytestmark = pytest.mark.timeout(180)

ENGINE_ARGS = ["--num-kv-blocks", "128", "--max-num-seqs", "64", "--seed", "0"]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
PROMPTS = ["Hello, world! How are you", "The quick brown fox", "Once upon a time there was"]


@pytest.fixture(scope="module")
def server(tiny_model):
    s = Server(tiny_model, *ENGINE_ARGS, "--served-model-name", "tiny")
    yield s
    out = s.output()
    s.stop()
    assert s.proc.returncode == 0, out  # SIGTERM: a graceful shutdown of server and core


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local(tiny_model):
    return hwkv.Engine(tiny_model, backend="cpu", num_kv_blocks=128, max_num_seqs=64, seed=0)


def chat_ids(model_dir, messages) -> list[int]:
    from hwkv.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return tok.encode(tok.apply_chat_template(messages, True), add_special_tokens=False)


def metrics(server) -> dict[str, float]:
    """Sample name (with labels but model_name) → value, parsed by the Prometheus text parser."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(server, timeout: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["hwkv_num_requests_running"] == 0 and m["hwkv_num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"requests still running: {m}"
        time.sleep(0.05)


def test_models_and_health(server, client):
    assert httpx.get(server.url + "/health").status_code == 200
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.max_model_len == 1024


def test_completions_equal_engine(client, local):
    want = local.generate(PROMPTS, hwkv.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                          use_tqdm=False)
    got = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=10, **GREEDY)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for w, c in zip(want, got.choices):
        assert (c.text, c.token_ids, c.finish_reason) == (w.text, w.token_ids, "length")
    assert got.usage.completion_tokens == 30
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    ids = want[0].prompt_token_ids  # token-id prompts too
    got = client.completions.create(model="tiny", prompt=ids, max_tokens=10, **GREEDY)
    assert got.choices[0].token_ids == want[0].token_ids


def test_chat_equals_engine(client, local, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    want = local.generate([chat_ids(tiny_model, messages)],
                          hwkv.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY)
    msg = got.choices[0].message
    assert (msg.role, msg.content, got.choices[0].finish_reason) == ("assistant", want.text, "length")
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_stop_string(client, local):
    full = local.generate([PROMPTS[0]], hwkv.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                          use_tqdm=False)[0].text
    stop = full[5:8]
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=20, stop=[stop], **GREEDY)
    c = got.choices[0]
    assert c.finish_reason == "stop" and c.text == full[: full.index(stop)] and c.stop_reason == stop


def test_streaming_equals_non_streaming(client):
    kw = dict(model="tiny", prompt=PROMPTS[1], max_tokens=12, logprobs=1, **GREEDY)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    body = [c.choices[0] for c in chunks[:-1]]
    assert "".join(c.text for c in body) == whole.text
    assert sum((c.token_ids for c in body), []) == whole.token_ids
    assert sum((c.logprobs.token_logprobs for c in body), []) == whole.logprobs.token_logprobs
    assert [c.finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]

    two = dict(model="tiny", prompt=PROMPTS[:2], max_tokens=6, **GREEDY)  # several prompts: one choice index each
    whole = client.completions.create(**two).choices
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(stream=True, **two):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {0: whole[0].text, 1: whole[1].text}

    messages = [{"role": "user", "content": "Tell me about the fox"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, **GREEDY).choices[0]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_64_concurrent_streams(server, local):
    prompts = [f"Request number {i} says hello" for i in range(64)]
    want = local.generate(prompts, hwkv.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)

    async def one(c: openai.AsyncOpenAI, p: str) -> tuple[str, list[int]]:
        text, ids = "", []
        async for ch in await c.completions.create(model="tiny", prompt=p, max_tokens=4, stream=True, **GREEDY):
            text += ch.choices[0].text
            ids += ch.choices[0].token_ids
        return text, ids

    async def go():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(asyncio.wait_for(go(), 120))
    assert got == [(w.text, w.token_ids) for w in want]
    m = wait_idle(server)
    assert m["hwkv_num_free_kv_blocks"] == m["hwkv_num_kv_blocks"]


def test_disconnect_mid_stream_frees_the_request(server):
    before = metrics(server)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines, chunks = r.iter_lines(), 0  # one iterator, kept open: closing it closes the connection
        while chunks < 3:
            chunks += next(lines).startswith("data: {")
        assert metrics(server)["hwkv_num_requests_running"] == 1
    # the connection is closed: the server aborts the request and the core frees its blocks
    m = wait_idle(server)
    assert m["hwkv_kv_cache_usage_perc"] == 0 and m["hwkv_num_free_kv_blocks"] == m["hwkv_num_kv_blocks"]
    assert m["hwkv_engine_steps_total"] - before["hwkv_engine_steps_total"] < 900  # not run to the end
    assert m["hwkv_request_success_total{finished_reason=abort}"] >= 1


def test_disconnect_while_waiting_frees_the_request(server):
    before = metrics(server)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    m = wait_idle(server)
    assert m["hwkv_num_free_kv_blocks"] == m["hwkv_num_kv_blocks"]
    assert m["hwkv_engine_steps_total"] - before["hwkv_engine_steps_total"] < 900


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("completions", {"temperature": 0}, "prompt"),
    ("completions", {"prompt": "hi", "logit_bias": {"x": 1.0}}, "logit_bias"),
    ("completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "priority": 1}, "priority"),
    ("completions", {"prompt": ["hi", ""]}, "prompt"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
])
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    r = httpx.post(f"{server.url}/v1/{path}", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-5", prompt="hi", max_tokens=2)


def test_metrics_parse(server, client):
    # 40 prompt tokens: two full blocks of 16 to cache. PROMPTS[0] is shorter than one block, so this test passed
    # only when an earlier test on the same server (and pytest-xdist worker) had made a hit.
    prompt = list(range(5, 45))
    client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)
    client.completions.create(model="tiny", prompt=prompt, max_tokens=3, **GREEDY)  # a prefix-cache hit
    m = wait_idle(server)
    for name in ("hwkv_num_requests_running", "hwkv_num_requests_waiting", "hwkv_kv_cache_usage_perc",
                 "hwkv_num_preemptions_total", "hwkv_prefix_cache_hit_rate"):
        assert name in m
    assert m["hwkv_prefix_cache_hits_total"] >= 32 and 0 < m["hwkv_prefix_cache_hit_rate"] <= 1
    assert m["hwkv_generation_tokens_total"] >= 6 and m["hwkv_prompt_tokens_total"] > 0
    for h in ("hwkv_time_to_first_token_seconds", "hwkv_inter_token_latency_seconds",
              "hwkv_e2e_request_latency_seconds"):
        assert m[h + "_count"] > 0 and m[h + "_sum"] > 0
    assert m["hwkv_request_success_total{finished_reason=length}"] >= 2


def test_bench_serve_against_the_server(server, tmp_path):
    from hwkv.commands.bench import benches

    assert "serve" in benches()
    import argparse

    from hwkv.bench import serve as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--base-url", server.url, "--request-rate", "40,inf", "--num-prompts", "6", "--input-len",
                         "12", "--output-len", "4", "--warmup", "1", "--out-dir", str(tmp_path)])
    assert bench.run(args) == 0
    (out,) = tmp_path.glob("serve-tiny-*.json")
    res = json.loads(out.read_text())
    assert res["server"]["backend"] == "cpu" and res["server"]["vocab_size"] == 512
    for r in res["results"]:
        assert (r["completed"], r["failed"], r["total_output_tokens"], r["total_input_tokens"]) == (6, 0, 24, 72)
        assert 0 < r["ttft"]["p50_ms"] <= r["e2e"]["p50_ms"] and r["itl"]["p50_ms"] > 0
    assert [r["request_rate"] for r in res["results"]] == [40.0, "inf"]


# ---- a second server: API key, a model without a chat template, a core that dies ------------------
def test_api_key_no_template_and_core_crash(tiny_model_no_template):
    s = Server(tiny_model_no_template, *ENGINE_ARGS, "--api-key", "sekret")
    try:
        url = s.url + "/v1"
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics stay open
        r = httpx.get(url + "/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=url, api_key="sekret", max_retries=0, timeout=30)
        assert c.models.list().data
        with pytest.raises(openai.BadRequestError, match="no chat template") as e:
            c.chat.completions.create(model=str(tiny_model_no_template), messages=[{"role": "user", "content": "x"}])
        assert e.value.body["param"] == "messages"

        stream = c.completions.create(model=str(tiny_model_no_template), prompt="Hello", max_tokens=900,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(s.core_pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="engine core process exited unexpectedly"):
            for _ in stream:
                pass
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "exited unexpectedly" in r.json()["error"]["message"]
        with pytest.raises(openai.APIStatusError, match="engine is not running") as e:
            c.completions.create(model=str(tiny_model_no_template), prompt="Hello", max_tokens=2)
        assert e.value.status_code == 503
    finally:
        s.stop()
    assert not alive(s.core_pid)


def test_chat_logprobs_and_completion_echo(client, local):
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                         logprobs=True, top_logprobs=2, **GREEDY)
    content = got.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob and c.token == c.top_logprobs[0].token for c in content)
    # token strings decode one token each: a character split over tokens shows as U+FFFD there
    assert "".join(c.token for c in content).startswith(got.choices[0].message.content)
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=4, echo=True, **GREEDY)
    want = local.generate([PROMPTS[2]], hwkv.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert got.choices[0].text == PROMPTS[2] + want.text


def test_bench_serve_writes_a_shape_model(tmp_path, monkeypatch):
    """`--model SHAPE` goes through the e2e bench's random-weight writer (the GPU command uses llama-1b)."""
    import argparse

    from hwkv.bench import e2e
    from hwkv.bench import serve as bench

    monkeypatch.setitem(e2e.SHAPES, "tiny-test", dict(arch="llama", hidden_size=64, num_layers=1, num_heads=4,
                                                      num_kv_heads=2, intermediate_size=128, vocab_size=512))
    d = bench._model_dir(argparse.Namespace(model="tiny-test", backend="cpu", dtype=None, workdir=str(tmp_path)))
    cfg = json.loads((tmp_path / "tiny-test-float32" / "config.json").read_text())
    assert d == str(tmp_path / "tiny-test-float32") and cfg["vocab_size"] == 512
    assert "llama-1b" in e2e.SHAPES


def test_bench_serve_stops_its_server_when_start_up_is_interrupted(monkeypatch):
    """Ctrl-C (or any error) while waiting for the server's health must not leave it running."""
    import argparse
    import subprocess
    import sys

    import httpx

    from hwkv.bench import serve as bench

    procs, real_popen = [], subprocess.Popen

    def popen(cmd, **kw):
        procs.append(real_popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw))
        return procs[-1]

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.subprocess, "Popen", popen)
    monkeypatch.setattr(httpx, "get", interrupted)
    args = argparse.Namespace(backend="cpu", server_args="", api_key=None, startup_timeout=30.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            bench._Server("unused", args)
        assert procs and procs[0].poll() is not None  # stopped, not orphaned
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_bench_serve_quotes_the_stderr_of_a_server_that_dies_starting(monkeypatch):
    """A server that exits during start-up (e.g. a package missing on the machine) names the cause."""
    import argparse
    import subprocess
    import sys

    from hwkv.bench import serve as bench

    real_popen = subprocess.Popen
    dies = "import sys; print(\"ModuleNotFoundError: No module named 'fastapi'\", file=sys.stderr); sys.exit(1)"
    monkeypatch.setattr(bench.subprocess, "Popen", lambda cmd, **kw: real_popen([sys.executable, "-c", dies], **kw))
    args = argparse.Namespace(backend="cpu", server_args="", api_key=None, startup_timeout=30.0)
    with pytest.raises(RuntimeError) as ei:
        bench._Server("unused", args)
    assert "exited with 1 during start-up" in str(ei.value)
    assert "No module named 'fastapi'" in str(ei.value)


def test_bench_serve_fails_the_requests_of_a_silent_server(monkeypatch):
    """A server that accepts but never answers costs a failed request after the read bound, not a hang."""
    import argparse
    import socket
    import threading

    from hwkv.bench import serve as bench

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns = []
    threading.Thread(target=lambda: conns.append(srv.accept()), daemon=True).start()
    monkeypatch.setattr(bench, "READ_TIMEOUT_S", 0.5)
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        res = asyncio.run(asyncio.wait_for(
            bench._run_rate(url, "m", float("inf"), [], [([1, 2], 4)], argparse.Namespace(max_concurrency=None),
                            {}, 0), 30))
        assert res["completed"] == 0 and res["failed"] == 1
    finally:
        for c, _ in conns:
            c.close()
        srv.close()


def test_serve_with_an_unreadable_tokenizer_is_a_clean_error(tiny_model, tmp_path, capsys):
    import argparse
    import shutil

    from hwkv.commands import serve as cmd

    d = tmp_path / "broken-tok"
    shutil.copytree(tiny_model, d)
    (d / "tokenizer.json").write_text("{")
    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    assert cmd.run(p.parse_args(["--model", str(d), "--backend", "cpu"])) == 1
    err = capsys.readouterr().err
    assert "hwkv serve: error:" in err and "tokenizer.json" in err and "Traceback" not in err

"""`hwkv serve` as a vLLM user drives it, through the official `openai` client: parallel sampling
(n > 1), structured outputs (response_format, structured_outputs, guided_*), tool calls, the vLLM
fields and endpoints (/tokenize, /detokenize, /version), the vLLM CLI spellings, and the request
path under hostile input (lone surrogates, non-UTF-8, deep JSON, huge bodies and prompts, a stalled
core, a shutdown mid-stream)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from scipy.stats import chisquare
from server_utils import Server
from test_server import local, metrics, wait_idle  # noqa: F401, F811 - local: a fixture

import hwkv

pytestmark = pytest.mark.timeout(180)

ENGINE_ARGS = ["--num-kv-blocks", "256", "--max-num-seqs", "128", "--seed", "0"]
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"


@pytest.fixture(scope="module")
def server(tiny_model):
    # positional model, vLLM spellings of engine flags, two served names, small request limits
    s = Server.positional(tiny_model, *ENGINE_ARGS, "--gpu-memory-utilization", "0.5", "-tp", "1",
                          "--served-model-name", "tiny", "tiny-alias", "--tool-call-parser", "hermes",
                          "--max-body-bytes", str(4 << 20), "--max-prompt-chars", str(3 << 20),
                          "--health-deadline", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path, body=None, content=None, **kw):
    return httpx.post(server.url + path, json=body, content=content, timeout=60, **kw)


def assert_error(r, code, param="-"):
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]
    if param != "-":
        assert err["param"] == param, err
    return err


# ---- vLLM endpoints and CLI -----------------------------------------------------------------------
def test_served_names_version_tokenize_detokenize(server, client, tiny_model):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    for name in ("tiny", "tiny-alias", str(tiny_model)):
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).choices
    from hwkv import __version__

    assert httpx.get(server.url + "/version").json() == {"version": __version__}
    r = post(server, "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True}).json()
    from hwkv.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 1024
    assert len(r["token_strs"]) == r["count"]
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"].endswith("Hello world")
    msgs = [{"role": "user", "content": "Hi"}]
    r = post(server, "/tokenize", {"messages": msgs}).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(msgs, True), add_special_tokens=False)
    assert_error(post(server, "/detokenize", {"tokens": [1, 99999]}), 400, "tokens")
    assert_error(post(server, "/tokenize", {"model": "nope", "prompt": "x"}), 404, "model")


def test_cli_hints_for_vllm_flags_and_the_model_given_twice(tiny_model, capsys):
    import argparse

    from hwkv.commands import serve as cmd

    p = argparse.ArgumentParser(prog="hwkv serve")
    cmd.add_arguments(p)
    with pytest.raises(SystemExit):
        p.parse_args([str(tiny_model), "--kv-transfer-config", '{"kv_connector": "NixlConnector"}'])
    err = capsys.readouterr().err
    assert "--kv-transfer-config is a vLLM flag" in err and "--kv-connector NAME --kv-connector-config JSON" in err
    args = p.parse_args([str(tiny_model), "--gpu-memory-utilization", "0.7", "-tp", "2"])
    assert (args.memory_fraction, args.tensor_parallel_size, cmd._model(args)) == (0.7, 2, str(tiny_model))
    assert cmd._model(p.parse_args(["a", "--model", "b"])) is None  # two different models: refused


# ---- request fields ---------------------------------------------------------------------------------
def test_vllm_fields(client, tiny_model):
    greedy = dict(model="tiny", temperature=0, max_tokens=12)
    full = client.completions.create(prompt="Once upon", extra_body={"ignore_eos": True}, **greedy).choices[0].text
    stop = full[4:6]
    got = client.completions.create(prompt="Once upon", stop=[stop], extra_body={
        "ignore_eos": True, "include_stop_str_in_output": True}, **greedy).choices[0]
    assert got.text == full[: full.index(stop) + len(stop)] and got.finish_reason == "stop"
    # logit_bias: +100 makes the token the argmax; -100 bans the greedy one
    got = client.completions.create(prompt="Once upon", logit_bias={"77": 100},
                                    extra_body={"ignore_eos": True, "return_token_ids": True}, **greedy).choices[0]
    assert got.token_ids == [77] * 12
    first = client.completions.create(prompt="Once upon", extra_body={"return_token_ids": True},
                                      **{**greedy, "max_tokens": 1}).choices[0].token_ids[0]
    got = client.completions.create(prompt="Once upon", logit_bias={str(first): -100},
                                    extra_body={"return_token_ids": True}, **{**greedy, "max_tokens": 1})
    assert got.choices[0].token_ids[0] != first
    # add_special_tokens (BOS) and a per-request chat template
    a = client.completions.create(prompt="Once upon", **{**greedy, "max_tokens": 1}).usage.prompt_tokens
    b = client.completions.create(prompt="Once upon", extra_body={"add_special_tokens": False},
                                  **{**greedy, "max_tokens": 1}).usage.prompt_tokens
    assert a == b + 1
    from hwkv.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model)
    got = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"chat_template": TEMPLATE}, **{**greedy, "max_tokens": 1})
    assert got.usage.prompt_tokens == len(tok.encode("[user]Hi>", add_special_tokens=False))


def test_prompt_logprobs_completions_and_chat(server, client, local, tiny_model):  # noqa: F811
    """vLLM's shape: completions per choice, chat at the top level; per prompt token None (the first)
    or {token id: {logprob, rank, decoded_token}}, the prompt token first; values as the engine's."""
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=2, n=2,
                                  extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    ids = local.tokenizer.encode("Once upon a time")
    want = local.generate([ids], hwkv.SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                          use_tqdm=False)[0].prompt_logprobs
    for c in r.choices:
        plp = c.prompt_logprobs
        assert len(plp) == r.usage.prompt_tokens == len(ids) and plp[0] is None
        for t, entry, rec in zip(ids[1:], plp[1:], want[1:]):
            assert next(iter(entry)) == str(t)  # the prompt token first
            assert {int(k): (v["logprob"], v["rank"]) for k, v in entry.items()}.keys() == rec.keys()
            for k, v in entry.items():
                assert abs(v["logprob"] - rec[int(k)][0]) < 1e-4 and v["rank"] == rec[int(k)][1]
                assert v["decoded_token"] == local.tokenizer.decode([int(k)], skip_special_tokens=False)
    # echo + logprobs covers the prompt too (as vLLM): None for the first token, then the prompt's values
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=2, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for t, v, top, rec in zip(ids[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], want[1:]):
        assert abs(v - rec[t][0]) < 1e-4 and 1 <= len(top) <= 2  # (token strings may collide as keys)
    assert r.choices[0].text.startswith("Once upon a time")
    msgs = [{"role": "user", "content": "Hi there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, extra_body={"prompt_logprobs": 0})
    plp = r.prompt_logprobs  # top level, as vLLM's ChatCompletionResponse
    assert len(plp) == r.usage.prompt_tokens and plp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in plp[1:])
    assert getattr(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1),
                   "prompt_logprobs", None) is None
    err = assert_error(post(server, "/v1/chat/completions", {"messages": msgs, "prompt_logprobs": 1, "stream": True}),
                       400, "prompt_logprobs")
    assert "stream" in err["message"]


# ---- parallel sampling ------------------------------------------------------------------------------
def test_n4_matches_the_model_distribution(server, client, local):  # noqa: F811
    """n=4 children sample independently from the prompt's distribution: 400 first tokens (4
    requests x 25 prompts x n=4) fit the top-5 distribution of the model's logprobs (chi-square)."""
    import math

    prompt = "The quick brown fox"
    ref = local.generate([prompt], hwkv.SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    top = ref.logprobs[0]
    toks = sorted(top, key=lambda t: -top[t])[:5]
    z = sum(math.exp(top[t]) for t in toks)
    want = [math.exp(top[t]) / z for t in toks]
    counts = dict.fromkeys(toks, 0)
    for _ in range(4):
        r = client.completions.create(model="tiny", prompt=[prompt] * 25, n=4, max_tokens=1, temperature=1,
                                      extra_body={"top_k": 5, "return_token_ids": True})
        assert sorted(c.index for c in r.choices) == list(range(100))
        assert r.usage.prompt_tokens == 25 * len(ref.prompt_token_ids)  # once per prompt, not per child
        for c in r.choices:
            counts[c.token_ids[0]] += 1
    assert sum(counts.values()) == 400
    p = chisquare([counts[t] for t in toks], [400 * w for w in want]).pvalue
    assert p > 1e-3, (counts, want)
    m = wait_idle(server)
    assert m["hwkv_num_free_kv_blocks"] == m["hwkv_num_kv_blocks"]


def test_n_children_are_seeded_apart_and_stream(client):
    kw = dict(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=1, seed=7,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = client.completions.create(n=4, **kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # not four copies of one sample
    # child j is seeded seed + j (as vLLM): the same as a single request with that seed
    assert client.completions.create(**{**kw, "seed": 9}).choices[0].text == texts[2]
    assert client.completions.create(n=4, **kw).choices[0].text == texts[0]  # reproducible
    streamed = {i: "" for i in range(4)}
    for chunk in client.completions.create(n=4, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(4)] == texts
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], n=3,
                                          max_tokens=4, temperature=1, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


# ---- structured outputs -----------------------------------------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


def valid(v) -> bool:
    return (isinstance(v, dict) and set(v) == {"name", "age", "color", "tags"} and isinstance(v["name"], str)
            and len(v["name"]) <= 12 and type(v["age"]) is int and 0 <= v["age"] <= 120
            and v["color"] in ("red", "green", "blue") and isinstance(v["tags"], list) and len(v["tags"]) <= 3
            and all(type(t) is bool for t in v["tags"]))


def test_100_json_schema_answers_all_parse_and_validate(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Describe a person as JSON."}], n=100, temperature=1,
        seed=0, max_tokens=200,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert len(r.choices) == 100
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        assert valid(json.loads(c.message.content)), c.message.content


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
     lambda t: __import__("re").fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_regex": "(yes|no), [0-9]{1,4}"}, lambda t: __import__("re").fullmatch("(yes|no), [0-9]{1,4}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, lambda t: t in ("alpha", "beta", "gamma")),
    ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
    ({"structured_outputs": {"grammar": 'start: "a" ("b" | "c")+ "d"'}},
     lambda t: __import__("re").fullmatch("a[bc]+d", t)),
    ({"guided_json": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999}},
                      "required": ["x"],
                      "additionalProperties": False}}, lambda t: type(json.loads(t)["x"]) is int),
])
def test_structured_output_kinds(client, body, check):
    for c in client.completions.create(model="tiny", prompt="Answer:", n=8, temperature=1, max_tokens=100, seed=0,
                                       extra_body=body).choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_json_object(server, client):
    """Any JSON object (a random model would nest forever: a bias toward '}' lets it close)."""
    close = post(server, "/tokenize", {"prompt": "}", "add_special_tokens": False}).json()["tokens"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON please"}], n=8,
                                       temperature=1, seed=0, max_tokens=200, logit_bias={str(close[0]): 4},
                                       response_format={"type": "json_object"})
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict), c.message.content


def test_structured_outputs_stream_and_bad_grammars_are_400(server, client):
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model="tiny", prompt="Answer:", max_tokens=100, stream=True, extra_body={"guided_choice": ["one", "two"]}))
    assert text in ("one", "two")
    for body, param in [({"guided_regex": "[a-"}, "guided_regex"),
                        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs"),
                        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                        ({"response_format": {"type": "xml"}}, "response_format")]:
        err = assert_error(post(server, "/v1/completions", {"prompt": "x", **body}), 400, param)
        assert "structured" in err["message"] or param in err["message"], err


# ---- tool calls ---------------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1,
                                                                                      "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]


def test_tool_choice_required_named_none_and_streamed(server, client):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                       temperature=1, max_tokens=200, n=4, seed=0, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message
        assert len(c.message.tool_calls) == 1  # parallel_tool_calls=False: one call
        for call in c.message.tool_calls:
            assert call.function.name in ("get_weather", "get_time") and call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            assert args.get("city") in ("Paris", "Oslo") if call.function.name == "get_weather" else args["tz"]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=named, max_tokens=50)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice=named,
                                                 max_tokens=50, stream=True))
    calls = streamed_calls(chunks)
    assert len(calls) == 1 and calls[0][0] == "get_time" and json.loads(calls[0][1])["tz"] in ("UTC", "CET")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="required",
                                                 max_tokens=200, stream=True, seed=1, temperature=1,
                                                 parallel_tool_calls=False))
    calls = streamed_calls(chunks)
    assert calls and all(n in ("get_weather", "get_time") and isinstance(json.loads(a), dict) for n, a in calls)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason in ("stop", "length")
    # auto with the server's hermes parser: the random model writes no call; its text is the content
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=TOOLS, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert_error(post(server, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}), 400, "tool_choice")


def test_tool_call_parsers():
    from hwkv.serving import tools

    content, calls = tools.parse("hermes", 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": '
                                           '{"tz": "UTC"}}\n</tool_call><tool_call>{"name": "f", "arguments": {}}'
                                           '</tool_call>')
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_time", "f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"tz": "UTC"}
    assert tools.parse("hermes", "no call here") == ("no call here", [])
    content, calls = tools.parse("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
                                                '{"name": "b", "parameters": {}}')
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {}]
    assert tools.parse("llama3_json", "Hello {there}") == ("Hello {there}", [])
    assert tools.may_start_call("hermes", "abc <tool_") == 4 and tools.may_start_call("hermes", "abc") == 3


@pytest.mark.parametrize("kind, text", [
    ("hermes", 'Let me.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "U\\"TC", "n": [1, {"a": "}"}]}}\n'
               '</tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call>'),
    ("hermes", '<tool_call>{"arguments": {"late": true}, "name": "named_last"}</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1, "s": "a b"}}; {"name": "b", "parameters": {}}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "New York"}}, {"name": "t", "parameters": {}}]'),
    (("named", "get_time"), '{"tz": "CET", "k": [1, 2]}'),
])
def test_call_stream_deltas_concatenate_to_the_parsed_calls(kind, text):
    """Fed the text one character at a time, the deltas rebuild exactly the calls the whole-text
    parser finds: names once complete, arguments as valid JSON with the same value."""
    from hwkv.serving import tools

    cs, deltas = tools.CallStream(kind), []
    for i in range(len(text) + 1):
        deltas += cs.update(text[:i])
    got: dict[int, list] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] == len(got) and d["function"]["arguments"] == ""
            got[d["index"]] = [d["function"]["name"], ""]
        else:
            got[d["index"]][1] += d["function"]["arguments"]
    if kind == "required" or isinstance(kind, tuple):
        choice = "required" if kind == "required" else {"type": "function", "function": {"name": kind[1]}}
        want = tools.forced_calls(text, choice)
    else:
        want = tools.parse(kind, text)[1]
    assert [(n, json.loads(a)) for n, a in got.values()] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want]
    if '"arguments": {"late"' not in text:  # arguments written before the name come at once with it
        assert sum("id" not in d for d in deltas) > len(want)  # the arguments came in pieces


# ---- hostile input ------------------------------------------------------------------------------------
def test_hostile_bodies_are_openai_format_400s(server):
    surrogate = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\udfff"}]}'
    err = assert_error(post(server, "/v1/chat/completions", content=surrogate,
                            headers={"content-type": "application/json"}), 400, "messages")
    assert "messages.0.content" in err["message"] and "surrogate" in err["message"]
    err = assert_error(post(server, "/v1/completions", content=b'{"prompt": "\xff\xfe"}'), 400)
    assert "UTF-8" in err["message"]
    deep = b'{"prompt": "x", "extra": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert "deeply" in assert_error(post(server, "/v1/completions", content=deep), 400)["message"]
    assert_error(post(server, "/v1/completions", content=b"[1, 2]"), 400)
    assert_error(post(server, "/v1/completions", content=b"{nope"), 400)
    assert_error(post(server, "/v1/completions", {"prompt": 5}), 400, "prompt")
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)
    err = assert_error(post(server, "/v1/completions", content=b"x" * (5 << 20)), 413)
    assert "--max-body-bytes" in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_huge_prompt_does_not_block_health(server):
    """A 2 MB prompt tokenizes on a worker thread: /health and other requests answer meanwhile."""
    text = "hello world, this is a test. " * 70_000  # 2.0 M characters: tokenized, then refused as too long
    result = {}

    def send():
        result["r"] = post(server, "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 1})

    t = threading.Thread(target=send)
    t.start()
    worst, n = 0.0, 0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        worst, n = max(worst, time.monotonic() - t0), n + 1
        time.sleep(0.02)
    t.join(60)
    assert_error(result["r"], 400, "max_tokens")
    assert worst < 1.0, f"/health took {worst:.2f} s while the prompt was tokenized ({n} probes)"
    # over --max-prompt-chars: refused before tokenizing
    err = assert_error(post(server, "/v1/completions", {"prompt": "x" * (3 << 20) + "y"}), 400, "prompt")
    assert "--max-prompt-chars" in err["message"]


def test_256_concurrent_streams(server):
    async def one(c: openai.AsyncOpenAI, i: int) -> list[int]:
        ids: list[int] = []
        async for ch in await c.completions.create(model="tiny", prompt=f"Request {i} says", max_tokens=6,
                                                   stream=True, temperature=0,
                                                   extra_body={"ignore_eos": True, "return_token_ids": True}):
            ids += ch.choices[0].token_ids
        return ids

    async def go():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(256)))

    t0 = time.monotonic()
    got = asyncio.run(asyncio.wait_for(go(), 150))
    assert len(got) == 256 and all(len(ids) == 6 for ids in got)
    m = wait_idle(server)
    assert m["hwkv_num_free_kv_blocks"] == m["hwkv_num_kv_blocks"]
    assert time.monotonic() - t0 < 150


def test_health_reports_a_stalled_core(server):
    """SIGSTOP the engine core: /health turns 503 after --health-deadline (3 s), 200 again once it runs."""
    os.kill(server.core_pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while True:
            r = httpx.get(server.url + "/health", timeout=5)
            if r.status_code == 503:
                break
            assert time.monotonic() < deadline, "/health stayed 200 with the core stopped"
            time.sleep(0.2)
        assert "stalled" in r.json()["error"]["message"]
    finally:
        os.kill(server.core_pid, signal.SIGCONT)
    deadline = time.monotonic() + 15
    while httpx.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_stream_cut_by_shutdown_ends_with_an_error_event_and_done(tiny_model):
    s = Server(tiny_model, *ENGINE_ARGS)
    try:
        # 16 children x 900 tokens: still streaming when the 4 s before the cut have passed
        body = {"prompt": "Once upon a time", "max_tokens": 900, "n": 16, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        with httpx.Client(timeout=60) as http, http.stream("POST", s.url + "/v1/completions", json=body) as r:
            it = r.iter_lines()
            while not any(ln.startswith("data: {") for ln in lines):
                lines.append(next(it))
            s.proc.send_signal(signal.SIGTERM)
            lines.extend(it)
        events = [ln for ln in lines if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert "shutting down" in err["message"] and err["code"] == 503
        assert s.proc.wait(30) == 0
    finally:
        s.stop()


def test_tool_choice_auto_parses_hermes_calls_streamed_and_not(client):
    """The model's text is forced (a regex) to contain a Hermes call after some content: the server's
    parser returns the content and the call; a stream sends the content, then the call whole."""
    call = '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, max_tokens=200,
              extra_body={"structured_outputs": {"regex": "Checking[.]" + __import__("re").escape(call)}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    want = [("get_time", {"tz": "UTC"})]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == want
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    assert "<tool_call>" not in text and text.startswith("Checking")
    assert [(n, json.loads(a)) for n, a in streamed_calls(chunks)] == want
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def streamed_calls(chunks) -> list[tuple[str, str]]:
    """``(name, arguments)`` of each streamed call, checking vLLM's delta shape on the way: the first
    delta of a call has its index, id, type and name, later ones only argument pieces, and the
    arguments stream before the last chunk (in several pieces unless tiny)."""
    calls: dict[int, list] = {}
    pieces_before_end = 0
    for n, ch in enumerate(chunks):
        for c in ch.choices:
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name, tc
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.id is None and not tc.function.name, tc
                    calls[tc.index][1] += tc.function.arguments
                    pieces_before_end += n < len(chunks) - 1
    assert sorted(calls) == list(range(len(calls)))
    total = sum(len(a) for _, a in calls.values())
    assert pieces_before_end >= 2 or total < 8, (pieces_before_end, calls)
    return [tuple(calls[k]) for k in sorted(calls)]

"""Engine API: streaming, abort, seeded sampling, stop strings, detokenization, validation."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.engine.detokenizer import IncrementalDetokenizer
from hwkv.model.tiny import write_tiny_model
from hwkv.model.tokenizer import Tokenizer

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog.", "What is two plus two?",
           "Once upon a time there was a little engine", "Water", "In the morning we drink coffee or tea;"]



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", max_position_embeddings=256))


@pytest.fixture(scope="module")
def engine(model_dir):
    return hwkv.Engine(model_dir, num_kv_blocks=48, max_model_len=128, max_num_batched_tokens=64)


def _no_leak(e: hwkv.Engine) -> None:
    assert not e.has_unfinished()
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
    assert not e.runner.reqs and not e.runner.generators and not e.scheduler.requests


def greedy(n: int = 12, **kw) -> hwkv.SamplingParams:
    return hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_streaming_matches_generate_and_reports_metrics(engine):
    ref = engine.generate(PROMPTS, greedy(), use_tqdm=False)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"s{i}", p, greedy())
    seen: dict[str, list[int]] = {}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            prev = seen.get(out.request_id, [])
            assert out.token_ids[: len(prev)] == prev and len(out.token_ids) > len(prev)  # cumulative
            seen[out.request_id] = out.token_ids
            if out.finished:
                final[out.request_id] = out
    for i, r in enumerate(ref):
        o = final[f"s{i}"]
        assert o.token_ids == r.token_ids and o.text == r.text and o.prompt == PROMPTS[i]
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finish_time
    _no_leak(engine)
    st = engine.stats()
    assert st["generation_tokens"] >= 2 * 12 * len(PROMPTS) and st["generation_tokens_per_s"] > 0
    assert 0 <= st["prefix_cache_hit_rate"] <= 1 and st["prefix_cache_hits"] > 0  # the repeat hit


def test_abort_mid_generation_frees_every_block(engine):
    for i, p in enumerate(PROMPTS * 2):
        engine.add_request(f"a{i}", p, greedy(40))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks < engine.kv_cache.spec.num_blocks
    engine.abort(["a0", "a3", "a7"])
    outs = {o.request_id: o for o in engine.step()}
    assert all(outs[r].finish_reason == "abort" and outs[r].finished for r in ("a0", "a3", "a7"))
    engine.step()
    engine.abort([f"a{i}" for i in range(len(PROMPTS) * 2)])  # the rest, running or waiting
    engine.step()
    _no_leak(engine)


def test_seeded_sampling_reproducible_across_runs_and_batches(model_dir, engine):
    def sp(seed):
        return hwkv.SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)

    a = engine.generate(PROMPTS[:4], [sp(i) for i in range(4)], use_tqdm=False)
    b = engine.generate([PROMPTS[2]], [sp(2)], use_tqdm=False)
    c = engine.generate(PROMPTS[:4][::-1], [sp(i) for i in range(4)][::-1], use_tqdm=False)
    assert b[0].token_ids == a[2].token_ids
    assert [o.token_ids for o in c[::-1]] == [o.token_ids for o in a]
    assert len({tuple(o.token_ids) for o in a}) == 4
    # A fresh engine with a KV pool small enough to preempt still draws the same tokens.
    small = hwkv.Engine(model_dir, num_kv_blocks=9, block_size=8, max_model_len=64, max_num_batched_tokens=32)
    d = small.generate(PROMPTS[:4], [sp(i) for i in range(4)], use_tqdm=False)
    assert small.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in d] == [o.token_ids for o in a]
    _no_leak(small)


def test_stop_strings_truncate_text(engine):
    (full,) = engine.generate([PROMPTS[1]], greedy(24), use_tqdm=False)
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    idx = text.find(stop)
    (out,) = engine.generate([PROMPTS[1]], greedy(24, stop=[stop]), use_tqdm=False)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:idx] and stop not in out.text
    assert full.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < 24
    _no_leak(engine)


def test_stop_token_ids_and_logprobs(engine):
    (full,) = engine.generate([PROMPTS[0]], greedy(10, logprobs=3), use_tqdm=False)
    assert len(full.logprobs) == 10
    for tok, lp in zip(full.token_ids, full.logprobs):
        assert tok in lp and max(lp.values()) == lp[tok] and len(lp) == 3  # greedy: sampled is top-1
    stop_tok = full.token_ids[4]
    (out,) = engine.generate([PROMPTS[0]], greedy(10, stop_token_ids=[stop_tok]), use_tqdm=False)
    first = full.token_ids.index(stop_tok)
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok


def test_incremental_detokenizer_multibyte(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    text = "Héllo wörld — 你好, 🙂 naïve café!"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False))
    partial = []
    for t in ids:
        detok.add_tokens([t])
        partial.append(detok.text)
        assert "\ufffd" not in detok.text
    assert detok.text == tok.decode(ids) == text
    assert all(text.startswith(p) for p in partial)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", None, "prompt must not be empty"),
        ([], None, "prompt must not be empty"),
        ([1, 2, 99999], None, "outside the vocabulary"),
        ([1, -1], None, "outside the vocabulary"),
        ("hi", "greedy", "sampling_params must be a SamplingParams"),
        (list(range(3, 100)), dict(max_tokens=40), "exceeds max_model_len 128"),
        ("hi", dict(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_request_validation(engine, prompt, params, match):
    sp = hwkv.SamplingParams(**params) if isinstance(params, dict) else params
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, sp)
    with pytest.raises(ValueError, match=match):
        engine.generate(["fine prompt", prompt], [None, sp], use_tqdm=False)
    _no_leak(engine)
    (ok,) = engine.generate(["still serving"], greedy(3), use_tqdm=False)  # the engine keeps working
    assert len(ok.token_ids) == 3


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
    ],
)
def test_sampling_params_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        hwkv.SamplingParams(**kw)


def test_duplicate_request_id(engine):
    engine.add_request("dup", "hello", greedy(2))
    with pytest.raises(ValueError, match="request_id 'dup' is already in use"):
        engine.add_request("dup", "again", greedy(2))
    while engine.has_unfinished():
        engine.step()
    _no_leak(engine)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(backend="no-such-backend"), "no-such-backend"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(memory_fraction=1.5), "memory_fraction"),
        (dict(max_model_len=4096), "max_model_len 4096 exceeds"),
        (dict(num_kv_blocks=2, max_model_len=128), "needs 8 KV blocks"),
        (dict(block_size=512), "block_size 512 not supported"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128), "max_num_batched_tokens"),
    ],
)
def test_engine_config_validation(model_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        hwkv.Engine(model_dir, **kw)


def test_generation_config_defaults(tmp_path):
    import json

    d = write_tiny_model(tmp_path / "m", arch="qwen2", max_position_embeddings=128)
    cfg = json.loads((d / "generation_config.json").read_text())
    cfg.update(temperature=0.0, max_new_tokens=5)
    (d / "generation_config.json").write_text(json.dumps(cfg))
    e = hwkv.Engine(str(d), num_kv_blocks=16)
    sp = e.default_sampling_params()
    assert sp.greedy and sp.max_tokens == 5
    a = e.generate("Hello", use_tqdm=False)[0]
    b = e.generate("Hello", hwkv.SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 5


def test_connector_hooks_through_the_engine(model_dir):
    from hwkv.connectors.base import KVConnectorBase
    from hwkv.core.sched_output import KVConnectorOutput

    class Recorder(KVConnectorBase):
        """Holds finished requests' blocks (delay_free) until the next get_finished reports them sent."""

        def __init__(self):
            self.calls, self.sending, self.registered = [], set(), None

        def register_kv_caches(self, kv_cache):
            self.registered = kv_cache

        def build_connector_meta(self, so):
            return {"n": len(so.num_scheduled_tokens)}

        def bind_connector_metadata(self, meta):
            self.calls.append(("bind", meta["n"]))

        def request_finished(self, request, block_ids):
            assert block_ids
            self.sending.add(request.request_id)
            return True, {"sent": True}

        def get_finished(self, finished_req_ids):
            done, self.sending = self.sending, set()
            return KVConnectorOutput(finished_sending=done) if done else None

    conn = Recorder()
    e = hwkv.Engine(model_dir, num_kv_blocks=48, max_model_len=128, kv_connector=conn)
    ref = hwkv.Engine(model_dir, num_kv_blocks=48, max_model_len=128).generate(PROMPTS, greedy(6), use_tqdm=False)
    outs = e.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert conn.registered is e.kv_cache and conn.calls[0] == ("bind", len(PROMPTS))
    assert e.scheduler.delayed_free  # the last finishers' blocks are still held by the connector
    e.step()  # the runner's get_finished reports them sent; the scheduler frees them
    assert not e.scheduler.delayed_free
    _no_leak(e)

"""Async scheduling (plan and launch step N+1 before step N's tokens are read) gives exactly the
synchronous engine's results: same tokens, finish reasons, texts, logprobs; nothing leaks.

Runs on the CPU reference backend (``async_scheduling=True`` forces the path there); on a GPU the
same code overlaps the host work with the device (tests/engine/test_cuda_graphs.py runs it there).
"""

from __future__ import annotations

import random

import pytest

import hwkv
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("async") / "llama", max_position_embeddings=256))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(20)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for i in range(n)]


def _engine(model_dir: str, async_: bool, **kw) -> hwkv.Engine:
    kw = dict(dict(num_kv_blocks=64, max_model_len=160, max_num_batched_tokens=64, block_size=16), **kw)
    e = hwkv.Engine(model_dir, async_scheduling=async_, **kw)
    assert e.async_scheduling is async_ and e.scheduler.config.async_scheduling is async_
    return e


def _no_leak(e: hwkv.Engine) -> None:
    assert not e.has_unfinished()
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
    assert not e.runner.reqs and not e.scheduler.requests and not e.scheduler.waiting
    assert all(r.num_output_placeholders == 0 for r in e.scheduler.running)


def _run(e: hwkv.Engine, prompts, params) -> list[tuple]:
    outs = e.generate(prompts, params, use_tqdm=False)
    _no_leak(e)
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text, o.logprobs) for o in outs]


def _greedy(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=3 + 5 * (i % 5), ignore_eos=True, **kw) for i in range(n)]


@pytest.mark.parametrize("kw", [
    {},
    dict(max_num_batched_tokens=32, long_prefill_token_threshold=16),  # chunked prefills between decodes
    dict(num_kv_blocks=14, max_num_seqs=8),  # preempts
    dict(enable_prefix_caching=False),
], ids=["default", "chunked", "preempting", "no-prefix-cache"])
def test_async_matches_sync_greedy(model_dir, kw):
    prompts, params = _prompts(12), _greedy(12)
    want = _run(_engine(model_dir, False, **kw), prompts, params)
    e = _engine(model_dir, True, **kw)
    assert _run(e, prompts, params) == want
    if "num_kv_blocks" in kw:
        assert e.scheduler.num_preemptions > 0
    # nothing was computed for a request whose pending token ended it by length
    assert e.stats()["generation_tokens"] == sum(len(t[0]) for t in want)


def test_async_static_decode_path(model_dir):
    """The static-buffer decode path (CUDA-graph path run eagerly) with device-side input fill."""
    prompts, params = _prompts(9, seed=3), _greedy(9)
    want = _run(_engine(model_dir, False), prompts, params)
    e = _engine(model_dir, True)
    e.runner.enable_graphs(max_batch=4, use_graphs=False)  # 5..9 running decodes go eager
    assert _run(e, prompts, params) == want
    assert e.runner.num_graph_steps > 10


@pytest.mark.parametrize("seed", range(4))
def test_async_matches_sync_with_stop_tokens(model_dir, seed):
    """Requests ending by a stop token (unknown when the next step is planned) — also while
    preempted — finish at the same token; the extra planned token is dropped."""
    prompts = _prompts(10, seed=seed)
    base = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = _run(_engine(model_dir, False), prompts, [base] * 10)
    rng = random.Random(seed)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[rng.choice(t[0][1:])]) for t in first]
    kw = dict(num_kv_blocks=12, max_num_seqs=6)
    want = _run(_engine(model_dir, False, **kw), prompts, params)
    assert any(t[1] == "stop" for t in want)
    assert _run(_engine(model_dir, True, **kw), prompts, params) == want


def test_async_matches_sync_sampling_features(model_dir):
    """Seeded sampling, penalties (need the full history, so step N's token is read before N+1
    samples), min_tokens, logprobs and stop strings."""
    prompts = _prompts(6, seed=5)
    texts = [o.text for o in _engine(model_dir, False).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    params = [
        SamplingParams(temperature=0.9, top_k=30, seed=7, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=10, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=12, stop=[texts[3][4:7]], ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=9, min_p=0.05, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
    ]
    want = _run(_engine(model_dir, False), prompts, params)
    assert want[3][1] == "stop"
    assert _run(_engine(model_dir, True), prompts, params) == want


def test_async_abort_and_streaming(model_dir):
    """step() streams one step late; an abort while a step is in flight frees everything."""
    prompts, params = _prompts(4, seed=6), _greedy(4)
    want = {f"r{i}": t for i, t in enumerate(_run(_engine(model_dir, False), prompts, params))}
    e = _engine(model_dir, True)
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, params[i])
    assert e.step() == []  # the first step's tokens are applied by the second call
    e.step()
    e.abort("r1")
    done = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
    assert done["r1"].finish_reason == "abort"
    for rid in ("r0", "r2", "r3"):
        assert done[rid].token_ids == want[rid][0]
    e.step()  # drains the last launched step (its tokens belong to finished requests)
    _no_leak(e)


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_async_failed_step_rolls_back(model_dir, monkeypatch, where):
    """A step that fails before (forward) or after (sampler) the previous step's tokens were read:
    those tokens are applied, the failed step's requests restart by recompute, nothing leaks."""
    import hwkv.engine.model_runner as mr

    prompts, params = _prompts(5, seed=7), _greedy(5)
    want = {f"r{i}": t[0] for i, t in enumerate(_run(_engine(model_dir, False), prompts, params))}
    e = _engine(model_dir, True)
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, params[i])
    done = {o.request_id: o.token_ids for _ in range(3) for o in e.step() if o.finished}

    def boom(*a, **k):
        raise RuntimeError("device lost")

    with monkeypatch.context() as m:
        m.setattr(*((e.runner, "_forward", boom) if where == "forward" else (mr, "sample_tokens", boom)))
        with pytest.raises(RuntimeError, match="device lost"):
            e.step()
    assert e.scheduler.num_running == 0
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
    assert all(r.num_output_placeholders == 0 for r in e.scheduler.requests.values())
    while e.has_unfinished():
        done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    assert done == want
    _no_leak(e)


def test_finished_id_is_reusable_while_its_last_step_is_in_flight(model_dir):
    # The engine's internal ids are unique per lifetime: the new "x" never meets the token the
    # launched step still carries for the old one.
    e = _engine(model_dir, True)
    prompt = _prompts(1, seed=8)[0]
    toks = _engine(model_dir, False).generate([prompt], _greedy(1)[0], use_tqdm=False)[0].token_ids
    e.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[toks[1]],
                                             ignore_eos=True))
    finished = []
    while not finished:
        finished = [o for o in e.step() if o.finished]
    assert finished[0].finish_reason == "stop"
    assert e._inflight is not None  # the step planned after "x"'s stop token is still launched
    e.add_request("x", prompt, _greedy(1)[0])
    assert [o.token_ids for o in e.generate([], use_tqdm=False)] == []
    final = []
    while e.has_unfinished():
        final += [o for o in e.step() if o.finished]
    assert [(o.request_id, o.token_ids) for o in final] == [("x", toks)]
    e.step()
    _no_leak(e)


def test_async_scheduling_stays_on_with_a_connector(model_dir):
    """A connector no longer forces synchronous steps (it used to raise): same tokens as without."""
    from hwkv.connectors.base import NoOpConnector

    class Acting(NoOpConnector):  # any real connector
        pass

    prompts, params = _prompts(6, seed=3), _greedy(6)
    assert _run(_engine(model_dir, True, kv_connector=Acting()), prompts, params) == \
        _run(_engine(model_dir, False), prompts, params)
    assert _engine(model_dir, True, kv_connector=NoOpConnector()).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling"):
        hwkv.Engine(model_dir, num_kv_blocks=16, async_scheduling="on")


def test_weight_prefetch_hooks_order_and_no_effect(model_dir):
    """The forward asks for qkv of layer 0 first, then per layer o_proj (before attention) and the
    next layer's qkv (before the MLP), joins once at its end; tokens are unchanged."""
    prompts, params = _prompts(4, seed=9), _greedy(4)
    want = _run(_engine(model_dir, False), prompts, params)
    e = _engine(model_dir, True)
    calls: list[object] = []
    e.model.set_prefetch(lambda ts: calls.extend(ts), lambda: calls.append("join"))
    assert _run(e, prompts, params) == want
    layers = e.model.model.layers
    one = [layers[0].self_attn.qkv_proj.weight]
    for i, layer in enumerate(layers):
        one.append(layer.self_attn.o_proj.weight)
        if i + 1 < len(layers):
            one.append(layers[i + 1].self_attn.qkv_proj.weight)
    one.append("join")
    assert len(calls) % len(one) == 0 and len(calls) > 0
    for k in range(0, len(calls), len(one)):
        assert all(a is b for a, b in zip(calls[k:k + len(one)], one))
    from hwkv.bench.common import enable_weight_prefetch

    with pytest.raises(ValueError, match="device cpu:0 has none"):  # a bench experiment, not an Engine option
        enable_weight_prefetch(e)
    with pytest.raises(TypeError, match="prefetch_weights"):
        _engine(model_dir, False, prefetch_weights=True)

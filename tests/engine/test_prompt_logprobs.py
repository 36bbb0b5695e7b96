"""SamplingParams.prompt_logprobs (vLLM's): the log-probability and rank of every prompt token after
the first given the tokens before it, plus the top-n there — equal to the distribution the engine
samples from at that prefix, the same under chunked prefill, async scheduling, a batch of other
requests and a warm prefix cache (a request asking for them reads no cached blocks), nothing left
allocated; refused by name where the runner cannot compute them."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.model.tiny import write_tiny_model

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("plp") / "tiny", seed=0, max_position_embeddings=512)


@pytest.fixture(scope="module")
def engine(model):
    return hwkv.Engine(model, backend="cpu", num_kv_blocks=64, block_size=8)


def run(e, prompts, k, **kw):
    sp = hwkv.SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k, **kw)
    return e.generate(prompts, sp, use_tqdm=False)


def forced_logprob(e, prefix: list[int], token: int) -> tuple[float, dict[int, float]]:
    """The engine's own logprob of ``token`` after ``prefix`` (sampled by a +100 bias; logprobs are of
    the unbiased distribution) and the top-20 there."""
    sp = hwkv.SamplingParams(temperature=0, max_tokens=1, logprobs=20, logit_bias={token: 100})
    lp = e.generate([prefix], sp, use_tqdm=False)[0].logprobs[0]
    return lp[token], lp


def same(a, b, tol=1e-4):
    assert len(a) == len(b) and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t][0] - y[t][0]) < tol and x[t][1] == y[t][1], (t, x[t], y[t])


def test_values_ranks_and_top_n_equal_the_sampling_distribution(engine):
    out = run(engine, [PROMPT], 3)[0]
    plp = out.prompt_logprobs
    assert len(plp) == len(PROMPT) and plp[0] is None
    for j in (1, 7, 8, 9, 23, 39):  # around block edges and the last prompt token
        rec, tok = plp[j], PROMPT[j]
        want, top = forced_logprob(engine, PROMPT[:j], tok)
        assert abs(rec[tok][0] - want) < 1e-4
        order = sorted(top.items(), key=lambda kv: -kv[1])
        assert rec[tok][1] == 1 + sum(v > want for v in top.values()) or rec[tok][1] > 20
        tops = sorted(((r, t) for t, (_, r) in rec.items() if t != tok or r <= 3))[:3]
        assert [t for _, t in tops] == [t for t, _ in order[:3]]
        assert all(abs(rec[t][0] - v) < 1e-4 for t, v in order[:3])
    assert all(len(r) in (3, 4) for r in plp[1:])  # top-3 plus the prompt token when outside them
    zero = run(engine, [PROMPT], 0)[0].prompt_logprobs
    assert all(list(z) == [t] for z, t in zip(zero[1:], PROMPT[1:]))
    assert run(engine, [PROMPT], None)[0].prompt_logprobs is None


@pytest.mark.parametrize("async_", [False, True])
def test_chunked_batched_and_prefix_cached_runs_agree(model, engine, async_):
    want = run(engine, [PROMPT], 2)[0].prompt_logprobs
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
                    async_scheduling=async_)
    other = list(range(100, 130))
    first = run(e, [PROMPT[:24]], None)  # warms the prefix cache with the prompt's first 3 blocks
    assert first[0].prompt_logprobs is None
    outs = run(e, [other, PROMPT, PROMPT[:30]], 2)  # 16-token chunks, three requests, cached blocks
    same(outs[1].prompt_logprobs, want)
    same(outs[2].prompt_logprobs, want[:30])
    assert outs[1].metrics.num_cached_tokens == 0  # every prompt token computed
    again = run(e, [PROMPT], None)[0]  # a request without them still reads the cache
    assert again.metrics.num_cached_tokens > 0
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks and not e.runner.reqs


def test_refused_by_name_with_speculative_decoding(model):
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_logprobs is not supported"):
        run(e, [PROMPT], 1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        hwkv.SamplingParams(prompt_logprobs=21)

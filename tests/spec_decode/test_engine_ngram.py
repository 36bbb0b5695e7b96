"""Engine with speculative decoding (n-gram proposer): greedy output token-identical to
non-speculative decoding under prefix caching, chunked prefill, preemption and stop conditions;
every block returned; stats; config validation."""

from __future__ import annotations

import random

import pytest

from hwkv.engine.engine import Engine
from hwkv.sampling_params import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    """Repetitive prompts (so the n-gram proposer drafts) sharing a prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(9)]
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 500) for _ in range(rng.randint(2, 5))]
        out.append((shared if i % 2 else []) + motif * rng.randint(2, 6))
    return out


def _run(model: str, prompts, params, spec=None, **kw):
    kw = {"num_kv_blocks": 96, "block_size": 4, **kw}
    eng = Engine(model, speculative_config=spec, **kw)
    outs = eng.generate(prompts, params, use_tqdm=False)
    assert not eng.has_unfinished()
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache.spec.num_blocks  # nothing leaked
    assert not eng.runner.reqs
    return outs, eng


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def speculate_like_plain(model: str, prompts, spec, **kw) -> Engine:
    """Greedy tokens of an engine speculating with ``spec`` are the plain engine's (asserted, both
    leaving nothing behind); the speculating engine is returned for its stats."""
    base, _ = _run(model, prompts, GREEDY, **kw)
    outs, eng = _run(model, prompts, GREEDY, spec, **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    return eng

CASES = {
    "default": {},
    "no_prefix_cache": {"enable_prefix_caching": False},
    "chunked_small_budget": {"max_num_batched_tokens": 7, "long_prefill_token_threshold": 5},
    "preemption_tiny_pool": {"num_kv_blocks": 24, "max_num_seqs": 6},
    "lookahead_k5": {},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_to_nonspeculative(tiny_model: str, case: str) -> None:
    kw = CASES[case]
    spec = dict(NGRAM, num_speculative_tokens=5) if case == "lookahead_k5" else NGRAM
    prompts = _prompts()
    base, base_eng = _run(tiny_model, prompts, GREEDY, **kw)
    outs, eng = _run(tiny_model, prompts, GREEDY, spec, **kw)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    st = eng.stats()["spec_decode"]
    assert st["draft_tokens"] > 0 and st["accepted_tokens"] > 0  # drafts were verified and used
    assert len(st["acceptance_rate_per_position"]) == spec["num_speculative_tokens"]
    if case == "preemption_tiny_pool":
        assert eng.stats()["num_preemptions"] > 0
    if case != "chunked_small_budget":  # (there drafts compete with prompt chunks for the budget)
        assert eng.stats()["num_steps"] < base_eng.stats()["num_steps"]  # speculation saved steps


def test_prefix_cache_never_holds_unverified_kv(tiny_model: str) -> None:
    """Run the same prompts twice on one engine: the second round hits blocks the first cached
    while speculating, and its greedy outputs still equal the non-speculative ones."""
    prompts = _prompts(4, seed=3)
    base, _ = _run(tiny_model, prompts, GREEDY)
    eng = Engine(tiny_model, num_kv_blocks=96, block_size=4, speculative_config=NGRAM)
    first = eng.generate(prompts, GREEDY, use_tqdm=False)
    # extend each prompt by its own output: its blocks of generated (once speculative) tokens hit
    again = eng.generate([p + o.token_ids for p, o in zip(prompts, first)], GREEDY, use_tqdm=False)
    assert eng.stats()["prefix_cache_hits"] > 0
    ref, _ = _run(tiny_model, [p + o.token_ids for p, o in zip(prompts, base)], GREEDY)
    assert [o.token_ids for o in first] == [o.token_ids for o in base]
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache.spec.num_blocks


def test_stops_inside_accepted_drafts(tiny_model: str) -> None:
    """max_tokens, stop token ids and stop strings cut a step's accepted drafts exactly where
    non-speculative decoding stops."""
    prompts = _prompts(4, seed=5)
    base, _ = _run(tiny_model, prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for i, o in enumerate(base):
        toks = o.token_ids
        # a stop id that first appears mid-output; a max_tokens that is not a step boundary
        stop_id = toks[7 + i]
        cut = toks.index(stop_id) + 1
        for params in (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]),
                       SamplingParams(temperature=0.0, max_tokens=cut, ignore_eos=True)):
            ref, _ = _run(tiny_model, [prompts[i]], params)
            out, _ = _run(tiny_model, [prompts[i]], params, NGRAM)
            assert out[0].token_ids == ref[0].token_ids == toks[:cut]
            assert out[0].finish_reason == ref[0].finish_reason
    # stop strings: text of the non-speculative output decides where it ends
    text = base[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
        ref, _ = _run(tiny_model, [prompts[0]], params)
        out, _ = _run(tiny_model, [prompts[0]], params, NGRAM)
        assert out[0].text == ref[0].text and out[0].finish_reason == ref[0].finish_reason == "stop"


def test_seeded_sampling_reproducible_and_logprobs(tiny_model: str) -> None:
    prompts = _prompts(3, seed=7)
    params = SamplingParams(temperature=0.8, top_k=20, seed=123, max_tokens=20, ignore_eos=True, logprobs=2)
    a, eng = _run(tiny_model, prompts, params, NGRAM)
    b, _ = _run(tiny_model, prompts[:1], params, NGRAM)  # other batch: same tokens (per-request seed)
    assert a[0].token_ids == b[0].token_ids
    for o in a:
        assert len(o.logprobs) == len(o.token_ids) == 20
        assert all(t in lp for t, lp in zip(o.token_ids, o.logprobs))
    assert eng.stats()["generation_tokens"] == sum(len(o.token_ids) for o in a)


@pytest.mark.parametrize("bad, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "num_speculative_tokens": 2, "foo": 1}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ("ngram", "JSON"),
    ("[1]", "dict"),
])
def test_bad_config_refused(tiny_model: str, bad, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Engine(tiny_model, num_kv_blocks=16, block_size=4, speculative_config=bad)


def test_async_scheduling_refused(tiny_model: str) -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4, async_scheduling=True, speculative_config=NGRAM)


def test_json_text_config(tiny_model: str) -> None:
    """`hwkv serve --speculative-config '{...}'` hands the engine JSON text."""
    eng = Engine(tiny_model, num_kv_blocks=16, block_size=4,
                 speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert eng.config.speculative.num_speculative_tokens == 2 and not eng.config.runtime.async_scheduling
    assert eng.stats()["spec_decode"]["draft_tokens"] == 0

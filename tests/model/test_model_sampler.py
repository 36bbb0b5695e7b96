"""Sampler semantics (vLLM) and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from hwkv.model.sampler import (
    SamplingBatch,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    draw,
    make_generator,
    sample,
)
from hwkv.sampling_params import SamplingParams

INF = float("inf")


def batch(params, outputs=None, prompts=None, gens=None, **kw):
    return SamplingBatch(params, outputs or [[] for _ in params], prompts, gens, **kw)


def test_greedy_is_argmax_and_mixes_with_random_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0)] * 6
    assert sample(logits, batch(params)).token_ids == logits.argmax(-1).tolist()
    # near-zero temperature is greedy too; random rows do not disturb greedy rows
    params = [SamplingParams(temperature=1e-6), SamplingParams(temperature=1.0, seed=1)] * 3
    out = sample(logits, batch(params)).token_ids
    assert out[0::2] == logits[0::2].argmax(-1).tolist()


def test_top_k_top_p_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))
    kept = lambda x: (x > -INF).tolist()
    assert kept(apply_top_k_top_p(logits, torch.tensor([2, 4]), None)) == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert kept(apply_top_k_top_p(logits, torch.tensor([1, 3]), None)) == [[1, 0, 0, 0], [0, 1, 1, 1]]
    # top-p keeps the smallest set reaching p: 0.5 + 0.3 >= 0.7; 0.5 alone >= 0.45
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.45]))) == [[1, 1, 0, 0], [0, 0, 0, 1]]
    # the top token always survives, even for tiny p
    assert kept(apply_top_k_top_p(logits, None, torch.tensor([1e-6, 1.0]))) == [[1, 0, 0, 0], [1, 1, 1, 1]]
    # top-k then top-p
    assert kept(apply_top_k_top_p(logits, torch.tensor([3, 2]), torch.tensor([0.9, 0.9]))) == [
        [1, 1, 1, 0], [0, 0, 1, 1]]
    # min-p: keep p >= min_p * max_p: 0.3 * 0.5 = 0.15 keeps 0.5, 0.3, 0.15
    assert kept(apply_min_p(logits, torch.tensor([0.3, 0.5]))) == [[1, 1, 1, 0], [0, 0, 1, 1]]


def naive_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
    z = sum(math.exp(row[i]) for i in order)
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += math.exp(row[i]) / z
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("vocab", [40, 400])  # 400: k-limited candidate path; 40: full-sort path
def test_top_k_top_p_matches_naive(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(32, vocab, generator=g, dtype=torch.float64).float() * 3
    k = torch.randint(1, 40, (32,), generator=g)
    p = torch.rand(32, generator=g).clamp(min=0.05)
    got = apply_top_k_top_p(logits, k, p)
    for r in range(32):
        assert set(torch.nonzero(got[r] > -INF).flatten().tolist()) == naive_top_k_top_p(
            logits[r].tolist(), int(k[r]), float(p[r])), r
        assert torch.equal(got[r][got[r] > -INF], logits[r][got[r] > -INF])  # survivors keep their logits


def test_sampling_respects_masks_end_to_end():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]])).repeat(400, 1)
    for sp, allowed in [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.6), {0, 1}),
                        (SamplingParams(min_p=0.6), {0, 1}), (SamplingParams(top_k=3, top_p=0.99), {0, 1, 2})]:
        got = set(sample(logits, batch([sp] * 400, generator=torch.Generator().manual_seed(0))).token_ids)
        assert got == allowed, sp


def test_draw_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(5, 1)
    u = torch.tensor([0.0, 0.25, 0.4999, 0.5001, 1 - 2**-24])
    assert draw(probs, u).tolist() == [1, 1, 1, 3, 3]


def test_distribution_matches_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 40000
    logits = (torch.log(probs) * 2).repeat(n, 1)  # temperature 2 undoes the factor 2
    toks = sample(logits, batch([SamplingParams(temperature=2.0)] * n,
                                generator=torch.Generator().manual_seed(0))).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.01), freq


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    rep, freq, pres = 2.0, 0.5, 0.25
    prompt, output = [[0, 4]], [[3, 3, 1]]
    want = torch.tensor([[2.0 / rep, -1.0 * rep - freq * 1 - pres, 0.5, 3.0 / rep - freq * 2 - pres, -2.0 * rep]])
    t = lambda v: torch.tensor([v])
    got = apply_penalties(logits.clone(), prompt, output, t(rep), t(freq), t(pres))
    torch.testing.assert_close(got, want)
    # through sample(): greedy picks the argmax of the penalised logits (token 0, not the raw argmax 3)
    sp = SamplingParams(temperature=0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    assert sample(logits, batch([sp], output, prompt)).token_ids == [int(want.argmax())]
    # repetition only over the prompt tokens when nothing was generated yet
    sp = SamplingParams(temperature=0, repetition_penalty=10.0)
    assert sample(torch.tensor([[3.0, 2.0, 1.0]]), batch([sp], [[]], [[0]])).token_ids == [1]


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=1)]
    out = sample(logits, batch(params, [[5], [5], [5]], eos_token_ids=[1])).token_ids
    assert out == [3, 1, 1]  # row 0: eos 1 and stop 2 masked; row 1: only stop 2 masked; row 2: reached min


def test_seeded_rows_reproducible_across_batch_compositions():
    g = torch.Generator().manual_seed(42)
    steps = [torch.randn(8, 100, generator=g) for _ in range(6)]
    target = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)

    def run(position: int, others: list[SamplingParams], shared_seed: int, target=target) -> list[int]:
        params = list(others)
        params.insert(position, target)
        gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
        shared = torch.Generator().manual_seed(shared_seed)
        toks = []
        for logits in steps:
            rows = torch.cat([logits[1:1 + position], logits[:1], logits[1 + position:1 + len(params) - 1]])
            toks.append(sample(rows, batch(params, gens=gens, generator=shared)).token_ids[position])
        return toks

    alone = run(0, [], 0)
    assert len(set(alone)) > 1
    assert run(2, [SamplingParams(temperature=0.7), SamplingParams(seed=5), SamplingParams(temperature=0)], 1) == alone
    assert run(4, [SamplingParams(top_k=3, temperature=2.0)] * 7, 9) == alone
    assert run(0, [], 0, SamplingParams(temperature=1.5, top_p=0.95, seed=77)) != alone  # another seed differs


def test_logprobs_topn_and_sampled_token():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0, min_tokens=1)]
    out = sample(logits, batch(params, eos_token_ids=[2]))
    lp = logits.log_softmax(-1)
    assert out.token_ids == [1, 3] and out.logprobs[1] is None
    assert list(out.logprobs[0]) == [1, 2]
    assert math.isclose(out.logprobs[0][2], float(lp[0, 2]), rel_tol=1e-6)
    out = sample(logits, batch([SamplingParams(temperature=0, logprobs=0)] * 2))
    assert out.logprobs == [{1: pytest.approx(float(lp[0, 1]))}, {2: pytest.approx(float(lp[1, 2]))}]
    assert sample(logits, batch([SamplingParams()] * 2)).logprobs is None


def test_sample_rejects_mismatched_batch():
    with pytest.raises(ValueError, match="do not match 1 params"):
        sample(torch.zeros(2, 4), batch([SamplingParams()]))


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "in (0, 1]"),
    ({"top_p": 1.5}, "top_p", "in (0, 1]"),
    ({"top_k": -2}, "top_k", "-1 or 0 (disabled) or an integer >= 1"),
    ({"min_p": 1.5}, "min_p", "in [0, 1]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
    ({"frequency_penalty": 3.0}, "frequency_penalty", "in [-2, 2]"),
    ({"presence_penalty": -2.5}, "presence_penalty", "in [-2, 2]"),
    ({"logprobs": 21}, "logprobs", "[0, 20]"),
    ({"n": 2}, "n", "1"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "[0, max_tokens=10]"),
    ({"seed": "x"}, "seed", "None or an integer in [-9223372036854775808, 18446744073709551615]"),
    ({"stop": [""]}, "stop", "non-empty string"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "token ids"),
    ({"temperature": float("nan")}, "temperature", ">= 0"),
])
def test_sampling_params_validation(kwargs, field, allowed):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert msg.startswith(f"SamplingParams.{field} must be") and allowed in msg and "got" in msg


def test_sampling_params_defaults_and_normalisation():
    sp = SamplingParams(stop="###", top_k=0)
    assert sp.stop == ["###"] and sp.stop_token_ids == [] and not sp.greedy and not sp.uses_penalties
    assert SamplingParams(temperature=0).greedy and SamplingParams(presence_penalty=0.1).uses_penalties
    with pytest.raises(ValueError, match=r"stop_token_ids must be a list of token ids in \[0, 100\)"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)


@pytest.mark.parametrize("dev", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("v", [128256, 32000, 8192, 50257])  # 50257: no even split, the plain argmax
def test_chunked_argmax_is_argmax(v, dev):
    """argmax_rows over chunks (the device path) gives x.argmax(-1): ties to the first index (within and across
    chunks), -inf rows, NaN as the maximum (the first NaN)."""
    from hwkv.model.sampler import argmax_rows

    g = torch.Generator().manual_seed(v)
    x = torch.randn(6, v, generator=g)
    x[1, 5] = x[1, v - 3] = x[1].max() + 1  # a tie across chunks: the first wins
    x[2, 700:702] = 50.0  # a tie inside a chunk
    x[3] = float("-inf")  # every token masked
    x[4, 9000 % v] = float("nan")
    x[4, (9000 % v) + 1] = float("nan")
    x[5] = x[5].round()  # many ties
    x = x.to(dev)
    got, want = argmax_rows(x), x.argmax(-1)
    assert torch.equal(got, want), (got, want)
    assert torch.equal(argmax_rows(x[:1]), x[:1].argmax(-1))


def test_sample_tokens_takes_a_backends_argmax():
    """Plain greedy rows go to the backend's argmax where one is given; its None falls back to argmax_rows."""
    from hwkv.model.sampler import SamplingBatch, sample_tokens

    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    batch = SamplingBatch([SamplingParams(temperature=0.0)] * 3, [[]] * 3, plain=True)
    calls = []
    marked = torch.tensor([7, 8, 9])
    tokens, lp = sample_tokens(x, batch, argmax=lambda t: calls.append(t) or marked)
    assert lp is None and torch.equal(tokens, marked) and len(calls) == 1 and calls[0].dtype == torch.float32
    tokens, _ = sample_tokens(x, batch, argmax=lambda t: None)
    assert torch.equal(tokens, x.argmax(-1))

"""Rejection sampler: speculative sampling emits exactly the target's (non-speculative) distribution.

Statistical tests draw thousands of requests (each with its own seed where stated) and compare the
emitted tokens with non-speculative sampling of the same logits by chi-square homogeneity tests at
significance 1e-4 (runs are deterministic: fixed seeds), with teeth: a sampler that skips the
residual correction fails the same test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from hwkv.model.sampler import SamplingBatch, make_generator, processed_logits, sample_tokens, warped_probs
from hwkv.sampling_params import SamplingParams
from hwkv.spec_decode.rejection import rejection_sample

V, K, N = 12, 3, 6000
ALPHA = 1e-4

SETTINGS = {
    "plain": dict(temperature=1.0),
    "temp_topk": dict(temperature=0.7, top_k=5),
    "topp": dict(top_p=0.8),
    "minp": dict(temperature=1.3, min_p=0.1),
    "topk_topp": dict(top_k=6, top_p=0.85, temperature=0.9),
    "penalties": dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.3),
}


def _logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K + 1, V, generator=g) * 1.5


def _draft_probs(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(K, V, generator=g) * 2.0).softmax(-1)  # differs clearly from the target


def _homogeneous(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of 'a and b are draws of one distribution' (chi-square on the tokens either saw)."""
    ca, cb = np.bincount(a, minlength=V), np.bincount(b, minlength=V)
    keep = (ca + cb) > 0
    if keep.sum() < 2:
        return 1.0
    return float(chi2_contingency(np.stack([ca[keep], cb[keep]]))[1])


def _spec(params: SamplingParams, logits: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor,
          seeds: bool, prompt: list[int], out: list[int]) -> tuple[np.ndarray, np.ndarray]:
    n = drafts.shape[0]
    batch = SamplingBatch([params] * n, [list(out) for _ in range(n)], [prompt] * n,
                          [make_generator(s) for s in range(n)] if seeds else None,
                          torch.Generator().manual_seed(7))
    big = logits.repeat(n, 1)
    dp = q.repeat(n, 1) if q is not None else None
    toks, num = rejection_sample(big, drafts.tolist(), batch, dp)
    return toks.numpy(), num.numpy()


def _nonspec(params: SamplingParams, row: torch.Tensor, n: int, seed: int, prompt: list[int],
             out: list[int]) -> np.ndarray:
    batch = SamplingBatch([params] * n, [list(out) for _ in range(n)], [prompt] * n, None,
                          torch.Generator().manual_seed(seed))
    return sample_tokens(row.repeat(n, 1), batch)[0].numpy()


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("seeds", [False, True], ids=["shared_rng", "per_request_seeds"])
def test_first_and_second_token_match_nonspeculative(name: str, seeds: bool) -> None:
    params = SamplingParams(**SETTINGS[name])
    prompt, out = [1, 2, 3, 3], [3, 5]
    logits, q = _logits(list(SETTINGS).index(name)), _draft_probs(list(SETTINGS).index(name))
    g = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
    toks, num = _spec(params, logits, q, drafts, seeds, prompt, out)
    assert ((num >= 1) & (num <= K + 1)).all()
    # accepted prefix equals the drafts
    for j in range(K):
        m = num > j + 1
        assert (toks[m, j] == drafts.numpy()[m, j]).all()
    ref0 = _nonspec(params, logits[0], N, 3, prompt, out)
    assert _homogeneous(toks[:, 0], ref0) > ALPHA
    # second token, given the first was an accepted draft v: distributed as the target row 1 with v
    # appended to the outputs (penalties see it)
    v = int(np.bincount(toks[num >= 2, 0], minlength=V).argmax())
    sel = (num >= 2) & (toks[:, 0] == v)
    assert sel.sum() > 200
    ref1 = _nonspec(params, logits[1], N, 4, prompt, out + [v])
    assert _homogeneous(toks[sel, 1], ref1) > ALPHA


@pytest.mark.parametrize("name", ["plain", "topk_topp", "penalties"])
def test_deterministic_drafts_one_hot(name: str) -> None:
    """``draft_probs=None``: a proposer that picks its drafts deterministically (n-gram, greedy draft)."""
    params = SamplingParams(**SETTINGS[name])
    prompt, out = [4, 4, 7], [7]
    logits = _logits(5)
    p0 = warped_probs(processed_logits(logits[:1], SamplingBatch([params], [out], [prompt])), [params])[0]
    d0 = int(p0.argmax())  # a plausible draft, so the test sees acceptances and rejections
    drafts = torch.tensor([[d0, 1, 2]] * N)
    toks, num = _spec(params, logits, None, drafts, True, prompt, out)
    assert 0.05 < (num >= 2).mean() < 0.95
    assert _homogeneous(toks[:, 0], _nonspec(params, logits[0], N, 9, prompt, out)) > ALPHA


def test_teeth_wrong_residual_fails() -> None:
    """Accepting with p/q but then drawing the replacement from p (not the residual) is biased; the
    chi-square test must catch it, so the tests above have power."""
    params = SamplingParams()
    logits, q = _logits(1), _draft_probs(1)
    g = torch.Generator().manual_seed(2)
    d = torch.multinomial(q[0], N, replacement=True, generator=g)
    p = logits[0].softmax(-1)
    u = torch.rand(N, generator=g)
    acc = u * q[0][d] < p[d]
    repl = torch.multinomial(p, N, replacement=True, generator=g)
    wrong = torch.where(acc, d, repl).numpy()
    assert _homogeneous(wrong, _nonspec(params, logits[0], N, 3, [], [])) < ALPHA


def test_greedy_is_argmax_sequence() -> None:
    params = SamplingParams(temperature=0.0)
    logits = _logits(3)
    top = logits.argmax(-1).tolist()
    cases = [top[:3], [top[0], (top[1] + 1) % V, top[2]], [(top[0] + 1) % V, 0, 0], top[:2], []]
    rows = torch.cat([logits[: len(d) + 1] for d in cases])
    toks, num = rejection_sample(rows, cases, SamplingBatch([params] * len(cases), [[]] * len(cases)))
    got = [toks[i, : num[i]].tolist() for i in range(len(cases))]
    assert got == [top[:4], [top[0], top[1]], [top[0]], top[:3], [top[0]]]


def test_greedy_with_penalties_counts_drafts() -> None:
    """A draft accepted at position j is an output for row j + 1's penalties (as non-speculative)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=5.0)
    row = torch.zeros(V)
    row[3], row[4] = 2.0, 1.9
    logits = row.repeat(2, 1)
    toks, num = rejection_sample(logits, [[3]], SamplingBatch([params], [[]], [[0]]))
    # 3 is accepted; then its penalty makes 4 the argmax, exactly as sampling after emitting 3
    assert toks[0, : num[0]].tolist() == [3, 4]


def test_mixed_batch_and_empty_drafts() -> None:
    greedy, rand = SamplingParams(temperature=0.0), SamplingParams(seed=5)
    logits = _logits(8)
    drafts = [[int(logits[0].argmax())], [], [1, 2]]
    rows = torch.cat([logits[:2], logits[:1], logits[:3]])
    batch = SamplingBatch([greedy, rand, rand], [[], [], []], None, [None, make_generator(1), make_generator(2)])
    toks, num = rejection_sample(rows, drafts, batch)
    assert toks.shape == (3, 3) and num[0] == 2 and num[1] == 1
    assert (toks[1, 1:] == -1).all()
    # seeded rows reproduce whatever shares their batch
    batch2 = SamplingBatch([rand], [[]], None, [make_generator(2)])
    t2, n2 = rejection_sample(logits[:3], [[1, 2]], batch2)
    assert t2[0, : n2[0]].tolist() == toks[2, : num[2]].tolist()


def test_bad_shapes_refused() -> None:
    params = SamplingParams()
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(torch.zeros(2, V), [[1, 2]], SamplingBatch([params], [[]]))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, V), [[1, 2]], SamplingBatch([params], [[]]), torch.zeros(1, V))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_verify_on_host_equals_the_device_sampler(seed: int) -> None:
    """The all-greedy fast path (argmax read back, compared on the host) emits what the full sampler
    does for greedy rows: drafts that match the argmax partly, wholly, not at all, and none."""
    from hwkv.spec_decode.rejection import greedy_accept, greedy_verify

    rng = np.random.default_rng(seed)
    R, Kmax = 7, 4
    ks = rng.integers(0, Kmax + 1, R)
    logits = torch.from_numpy(rng.normal(size=(int(ks.sum()) + R, V)).astype(np.float32))
    top = logits.argmax(-1).numpy()
    starts = np.cumsum(ks + 1) - (ks + 1)
    drafts = []
    for r in range(R):  # agree with the argmax for a random prefix, then disagree
        agree = rng.integers(0, ks[r] + 1)
        d = [int(top[starts[r] + j]) if j < agree else int((top[starts[r] + j] + 1) % V) for j in range(ks[r])]
        drafts.append(d)
    toks, num = rejection_sample(logits, drafts, SamplingBatch([SamplingParams(temperature=0.0)] * R, [[]] * R))
    K = int(ks.max())
    top2d = np.full((R, K + 1), -7)  # columns past k must be ignored
    d2d = np.full((R, K), -9)
    for r in range(R):
        top2d[r, : ks[r] + 1] = top[starts[r] : starts[r] + ks[r] + 1]
        d2d[r, : ks[r]] = drafts[r]
    t_h, n_h = greedy_verify(top2d, d2d, ks)
    assert n_h.tolist() == num.tolist()
    want = [toks[r, : num[r]].tolist() for r in range(R)]
    assert [t_h[r, : n_h[r]].tolist() for r in range(R)] == want
    assert greedy_accept(top2d.tolist(), drafts) == want  # the small-batch form: plain Python per row

"""Engine level: with random sampling (temperature, top-k, top-p, penalties), speculative decoding
produces the same token distribution as non-speculative decoding — checked on the 2nd and 3rd
tokens, which come from verified drafts, over hundreds of per-request seeds (chi-square homogeneity
at significance 1e-4; deterministic)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from hwkv.sampling_params import SamplingParams

from .test_engine_ngram import _run

N = 500


def _pvalue(a: list[int], b: list[int]) -> float:
    keys = sorted(set(a) | set(b))
    ca = np.array([a.count(k) for k in keys])
    cb = np.array([b.count(k) for k in keys])
    return 1.0 if len(keys) < 2 else float(chi2_contingency(np.stack([ca, cb]))[1])


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=4),
    dict(temperature=1.0, top_p=0.7, repetition_penalty=1.3, frequency_penalty=0.4),
], ids=["topk", "topp_penalties"])
def test_spec_matches_nonspec_distribution(tiny_model: str, params: dict) -> None:
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    sps = [SamplingParams(**params, seed=s, max_tokens=3, ignore_eos=True) for s in range(N)]
    kw = dict(num_kv_blocks=N * 4, max_num_seqs=N, max_num_batched_tokens=N * 16)
    base, _ = _run(tiny_model, [prompt] * N, sps, **kw)
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_model}
    outs, eng = _run(tiny_model, [prompt] * N, sps, spec, **kw)
    assert eng.stats()["spec_decode"]["accepted_tokens"] > N // 2  # the later tokens went through verification
    for pos in (1, 2):
        a = [o.token_ids[pos] for o in base]
        b = [o.token_ids[pos] for o in outs]
        assert _pvalue(a, b) > 1e-4, (pos, sorted(set(a))[:8])

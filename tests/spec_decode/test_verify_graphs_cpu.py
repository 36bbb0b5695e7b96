"""Verify steps replay captured graphs (emulated on the CPU, :mod:`hwkv.testing.graphs`): a spec-decode
engine on a backend declaring ``graph_capture`` captures verify graphs per (batch bucket, seq-len bound)
at query length ``k + 1``; pure-verify steps replay them (counted) and greedy tokens equal both
non-speculative decoding and eager speculative decoding, for n-gram and draft-model proposers, across
batch sizes, ``k`` and preemption; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.sampling_params import SamplingParams
from hwkv.testing.graphs import GraphCpuBackend

from .test_engine_ngram import _prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _run(model: str, prompts, spec=None, **kw):
    kw = {"num_kv_blocks": 96, "block_size": 4, "max_model_len": 128, "fuse_elementwise": False, **kw}
    eng = Engine(model, backend=GraphCpuBackend(), speculative_config=spec, **kw)
    outs = [o.token_ids for o in eng.generate(prompts, GREEDY, use_tqdm=False)]
    assert not eng.has_unfinished() and not eng.runner.reqs
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache.spec.num_blocks  # nothing leaked
    return outs, eng


def _spec(method: str, k: int, model: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"method": "draft_model", "num_speculative_tokens": k, "model": model}


def _verify_replays(eng: Engine) -> int:
    return sum(g.replays for g, _, _ in eng.runner.verify_graphs.graphs.values())


CASES = [  # (method, k, max_num_seqs, prompts, extra engine args)
    ("ngram", 1, 1, 2, {}),
    ("ngram", 3, 4, "same", {}),  # one prompt 4 times: rows draft in lockstep (pure verify steps at batch 4)
    ("ngram", 3, 8, 7, {}),
    ("ngram", 4, 3, 6, {"num_kv_blocks": 26, "max_model_len": 96}),  # preemption
    ("draft_model", 1, 2, 3, {}),
    ("draft_model", 4, 8, 7, {}),
    ("draft_model", 3, 6, 6, {"num_kv_blocks": 26, "max_model_len": 96}),  # preemption
]


@pytest.mark.parametrize(("method", "k", "seqs", "n", "kw"), CASES)
def test_verify_graphs_replay_and_match(tiny_model: str, method: str, k: int, seqs: int, n, kw: dict) -> None:
    torch.set_num_threads(1)
    prompts = _prompts(1, seed=20 + k) * 4 if n == "same" else _prompts(n, seed=20 + k)
    kw = {"max_num_seqs": seqs, **kw}
    base, _ = _run(tiny_model, prompts, **kw)
    eager, eager_eng = _run(tiny_model, prompts, _spec(method, k, tiny_model), enforce_eager=True, **kw)
    got, eng = _run(tiny_model, prompts, _spec(method, k, tiny_model), **kw)
    assert eager_eng.runner.verify_graphs is None
    assert got == eager == base
    vg = eng.runner.verify_graphs
    assert vg is not None and vg.use_graphs and vg.q == k + 1
    assert {b for b, _ in vg.graphs} == {b for b, _ in eng.runner.graphs.graphs}  # every batch bucket
    st = eng.stats()
    steps = st["spec_decode"]["verify_graph_steps"]
    assert _verify_replays(eng) == steps  # verify steps really replayed
    # a draft model always drafts k; n-gram rows without a match make a batch's steps mixed (eager)
    assert steps > 0 or (method == "ngram" and n != "same" and seqs > 1)
    if method == "draft_model":  # the draft's own graphs: 1-token steps and 2-token catch-ups replay
        prop = eng.runner.proposer
        one, two = (sum(g.replays for g, _, _ in gr.graphs.values()) for gr in (prop.graphs, prop.catchup_graphs))
        assert (one > 0 or k == 1) and two > 0 and one + two == prop.num_graph_steps  # k = 1: no 1-token steps
        assert st["spec_decode"]["acceptance_rate"] == 1.0  # draft = target: the re-fed KV changed nothing
    if "max_model_len" in kw:
        assert st["num_preemptions"] > 0


def test_pure_verify_only(tiny_model: str) -> None:
    """A step with a prefilling request or a request with fewer drafts is no pure verify (stays eager)."""
    import numpy as np

    from hwkv.engine.inputs import build_batch

    eng = Engine(tiny_model, backend=GraphCpuBackend(), num_kv_blocks=32, block_size=4, max_model_len=64,
                 fuse_elementwise=False, speculative_config=_spec("ngram", 2, tiny_model))
    r = eng.runner
    toks, bt = np.zeros((2, 64), dtype=np.int32), np.arange(32, dtype=np.int32).reshape(2, 16)
    slots = np.arange(2)

    def batch(ql, ks):
        ql = np.array(ql)
        ctx = np.array([8, 8])
        return build_batch(toks, bt, slots, ctx, ql, ctx + ql, 4), np.array(ks)

    assert r._pure_verify(*batch([3, 3], [2, 2]))
    assert not r._pure_verify(*batch([3, 2], [2, 1]))  # fewer drafts
    assert not r._pure_verify(*batch([3, 3], [2, 0]))  # a 3-token prefill chunk beside a verify

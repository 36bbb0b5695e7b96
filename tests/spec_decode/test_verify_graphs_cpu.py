"""Verify steps replay captured graphs (emulated on the CPU, :mod:`hwkv.reference.graphs`): a spec-decode
engine on a backend declaring ``graph_capture`` captures verify graphs per (batch bucket, seq-len bound)
at query length ``k + 1``; pure-verify steps replay them (counted) and greedy tokens equal both
non-speculative decoding and eager speculative decoding, for n-gram and draft-model proposers, across
batch sizes, ``k`` and preemption; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.reference.graphs import GraphCpuBackend
from hwkv.sampling_params import SamplingParams

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
    assert steps > 0
    if method == "draft_model":  # the draft's own graphs: 1-token steps and 2-token catch-ups replay
        prop = eng.runner.proposer
        one, two = (sum(g.replays for g, _, _ in gr.graphs.values()) for gr in (prop.graphs, prop.catchup_graphs))
        assert (one > 0 or k == 1) and two > 0 and one + two == prop.num_graph_steps  # k = 1: no 1-token steps
        assert st["spec_decode"]["acceptance_rate"] == 1.0  # draft = target: the re-fed KV changed nothing
    if "max_model_len" in kw:
        assert st["num_preemptions"] > 0


def test_steady_state_verify_steps_build_padded_inputs_directly(tiny_model: str) -> None:
    """A verify step of cached requests builds the verify graphs' padded batch straight from the tables
    (``verify_batch``): the general route (``build_inputs``, then ``pad_queries``) serves only the other
    steps (the prefill, the last steps that have no drafts), and the tokens are non-speculative decoding's."""
    prompts = _prompts(1, seed=5)
    base, _ = _run(tiny_model, prompts, max_num_seqs=1)
    eng = Engine(tiny_model, backend=GraphCpuBackend(), num_kv_blocks=96, block_size=4, max_model_len=128,
                 fuse_elementwise=False, max_num_seqs=1, speculative_config=_spec("draft_model", 3, tiny_model))
    r, calls = eng.runner, {"steps": 0, "general": 0}
    step, build = r._step, r.build_inputs

    def count_step(*a):
        calls["steps"] += 1
        return step(*a)

    def count_build(*a):
        calls["general"] += 1
        return build(*a)
    r._step, r.build_inputs = count_step, count_build
    got = [o.token_ids for o in eng.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == base
    vsteps = eng.stats()["spec_decode"]["verify_graph_steps"]
    assert vsteps > 0 and calls["general"] + vsteps == calls["steps"]
    assert _verify_replays(eng) == vsteps


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_verification_large_batch_form(tiny_model: str, monkeypatch, enforce_eager: bool) -> None:
    """Greedy verification of batches above ``SMALL_BATCH`` (numpy over ``[R, k + 1]``) emits what the
    small-batch form (plain Python per row) does: non-speculative decoding's tokens, graphs or eager."""
    import hwkv.spec_decode.runner as runner_mod

    prompts = _prompts(6, seed=8)
    base, _ = _run(tiny_model, prompts, max_num_seqs=6)
    monkeypatch.setattr(runner_mod, "SMALL_BATCH", 0)
    got, eng = _run(tiny_model, prompts, _spec("ngram", 3, tiny_model), max_num_seqs=6,
                    enforce_eager=enforce_eager)
    assert got == base
    assert eng.stats()["spec_decode"]["accepted_tokens"] > 0


def test_pure_verify_only(tiny_model: str) -> None:
    """Decode rows with up to k drafts make a pure-verify step (fewer drafts: padded); a prefill chunk
    beside them, more than k drafts or a row that does not sample keep the step eager."""
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
    assert r._pure_verify(*batch([3, 2], [2, 1]))  # fewer drafts: padded
    assert r._pure_verify(*batch([1, 3], [0, 2]))  # no draft (an n-gram miss): padded
    assert not r._pure_verify(*batch([3, 3], [2, 0]))  # a 3-token prefill chunk beside a verify
    assert not r._pure_verify(*batch([4, 1], [3, 0]))  # more drafts than the graphs' k
    b, ks = batch([3, 3], [2, 2])
    assert not r._pure_verify(b._replace(sample_idx=b.sample_idx[:1]), ks)  # a row that does not sample


def test_pad_queries_keeps_real_tokens_and_pads_inertly() -> None:
    import numpy as np

    from hwkv.engine.graph_runner import pad_queries
    from hwkv.engine.inputs import build_batch

    toks = np.arange(3 * 64, dtype=np.int32).reshape(3, 64)
    bt = np.arange(48, dtype=np.int32).reshape(3, 16)
    ctx, ql = np.array([8, 5, 9]), np.array([3, 1, 2])
    b = build_batch(toks, bt, np.arange(3), ctx, ql, ctx + ql, 4)
    p = pad_queries(b, 3, 4)
    real = np.array([0, 1, 2, 3, 6, 7])
    assert p.input_ids[real].tolist() == b.input_ids.tolist()
    assert p.positions[real].tolist() == b.positions.tolist()
    assert p.slot_mapping[real].tolist() == b.slot_mapping.tolist()
    assert p.slot_mapping[[4, 5, 8]].tolist() == [-1, -1, -1]  # padding writes no KV
    assert p.seq_lens.tolist() == [11, 8, 12]  # real tokens keep their positions (seq_len - q + j)
    assert p.query_start_loc.tolist() == [0, 3, 6, 9] and p.max_query_len == 3
    assert p.block_tables.shape[1] * 4 >= 12 and (p.block_tables[:, :3] == b.block_tables).all()
    with pytest.raises(ValueError, match="not all in"):
        pad_queries(b, 2, 4)


def test_builder_with_host_rebinding_gets_no_multi_token_graphs(tiny_model: str, monkeypatch) -> None:
    """A metadata builder that re-binds host arguments per replay (``before_replay``) is taken to serve
    one-token queries only unless it declares ``supports_verify_graphs``: no verify or catch-up graphs
    then (verify steps eager), decode graphs as before, tokens unchanged."""
    from hwkv.reference.graphs import StaticAttentionBackend

    class Builder(type(StaticAttentionBackend().metadata_builder())):
        def before_replay(self, captured, step) -> None:
            pass

    monkeypatch.setattr(StaticAttentionBackend, "metadata_builder", lambda self: Builder())
    prompts = _prompts(3, seed=5)
    base, _ = _run(tiny_model, prompts, max_num_seqs=3)
    got, eng = _run(tiny_model, prompts, _spec("draft_model", 2, tiny_model), max_num_seqs=3)
    assert got == base
    assert eng.runner.graphs is not None and eng.runner.verify_graphs is None
    assert eng.runner.proposer.graphs is not None and eng.runner.proposer.catchup_graphs is None
    monkeypatch.setattr(Builder, "supports_verify_graphs", True, raising=False)
    _, eng = _run(tiny_model, prompts[:1], _spec("draft_model", 2, tiny_model), max_num_seqs=3)
    assert eng.runner.verify_graphs is not None and eng.stats()["spec_decode"]["verify_graph_steps"] > 0


def test_verify_graphs_with_penalties_match(tiny_model: str) -> None:
    """Requests that are not plain greedy (a repetition penalty) take the device rejection sampler on
    the verify graphs' logits (rows with fewer drafts gathered out): still token-identical to
    non-speculative decoding."""
    prompts = _prompts(5, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)
    kw = {"num_kv_blocks": 96, "block_size": 4, "max_model_len": 128, "fuse_elementwise": False, "max_num_seqs": 5}

    def run(spec):
        eng = Engine(tiny_model, backend=GraphCpuBackend(), speculative_config=spec, **kw)
        return [o.token_ids for o in eng.generate(prompts, params, use_tqdm=False)], eng

    base, _ = run(None)
    got, eng = run(_spec("ngram", 3, tiny_model))
    assert got == base
    assert eng.stats()["spec_decode"]["verify_graph_steps"] > 0


def test_greedy_verify_step_launches_no_more_ops_than_a_decode_step(tiny_model: str) -> None:
    """Host cost: a pure-verify step of plain greedy requests dispatches about as many torch ops outside
    its graph (input copies, one argmax, one read back) as a plain decode step — no per-step tensors
    built from host lists, no probabilities (each op is a kernel launch on a GPU, each host read a sync)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from hwkv.reference.graphs import RecordedGraph

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def ops_per_step(spec) -> tuple[float, Engine]:
        eng = Engine(tiny_model, backend=GraphCpuBackend(), num_kv_blocks=64, block_size=4, max_model_len=128,
                     fuse_elementwise=False, max_num_seqs=2, async_scheduling=False, speculative_config=spec)
        eng.add_request("a", [5, 6, 7, 8] * 6, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        for _ in range(3):
            eng.step()
        if spec is not None:  # the proposer's own forwards are not the verify path's
            prop = eng.runner.proposer.propose
            eng.runner.proposer.propose = lambda *a: _outside(prop, *a)
        vg = getattr(eng.runner, "verify_graphs", None)
        steps = 0 if vg is None else eng.runner.num_verify_graph_steps
        with Count():
            Count.n = 0
            for _ in range(4):
                eng.step()
        if vg is not None:
            assert eng.runner.num_verify_graph_steps - steps == 4  # every counted step verified on a graph
        return Count.n / 4, eng

    orig = RecordedGraph.replay
    try:  # ops a replay re-runs are the graph's, not the host path's
        RecordedGraph.replay = lambda self: _outside(orig, self)  # type: ignore[method-assign]
        base, _ = ops_per_step(None)
        got, eng = ops_per_step(_spec("draft_model", 3, tiny_model))
    finally:
        RecordedGraph.replay = orig  # type: ignore[method-assign]
    assert eng.stats()["spec_decode"]["acceptance_rate"] == 1.0  # draft = target: 4 tokens per step
    assert got <= base + 2, (got, base)


def _outside(fn, *args):
    """``fn(*args)`` with no dispatch mode active (its ops are not counted)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return fn(*args)


@pytest.mark.parametrize(("method", "kw"), [("eagle", {}), ("eagle3", {}),
                                            ("eagle", {"num_kv_blocks": 26, "max_model_len": 96})])  # preemption
def test_eagle_steps_replay_graphs_and_match(tiny_model: str, tiny_eagle: str, tmp_path, method: str,
                                             kw: dict) -> None:
    """EAGLE: decode and verify steps replay graphs that also return the target's states (EAGLE-3: the
    aux layers' residual streams, captured by hooks inside the graph); greedy tokens equal
    non-speculative and eager speculative decoding."""
    from .conftest import write_tiny_eagle3

    head = tiny_eagle if method == "eagle" else write_tiny_eagle3(tmp_path / "e3")
    spec = {"method": method, "num_speculative_tokens": 3, "model": head}
    prompts = _prompts(6, seed=41)
    kw = {"max_num_seqs": 4, **kw}
    base, _ = _run(tiny_model, prompts, **kw)
    eager, _ = _run(tiny_model, prompts, spec, enforce_eager=True, **kw)
    got, eng = _run(tiny_model, prompts, spec, **kw)
    assert got == eager == base
    st = eng.stats()
    steps = st["spec_decode"]["verify_graph_steps"]
    assert steps > 0 and _verify_replays(eng) == steps
    assert st["spec_decode"]["draft_tokens"] > 0
    if "max_model_len" in kw:
        assert st["num_preemptions"] > 0


def test_eagle_head_sees_target_state_of_its_position_on_graphs(tiny_model: str, tiny_eagle: str, tmp_path) -> None:
    """The states a verify graph returns are re-laid from its padded rows to the batch's tokens: a head
    that copies the target's state drafts exactly the token the target just chose, also when rows
    verify fewer than k drafts."""
    from .test_engine_eagle import _copy_head, _spy_drafts

    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": _copy_head(tmp_path, tiny_eagle)}
    eng = Engine(tiny_model, backend=GraphCpuBackend(), num_kv_blocks=96, block_size=4, max_model_len=128,
                 fuse_elementwise=False, max_num_seqs=4, speculative_config=spec)
    seen = _spy_drafts(eng)
    eng.generate(_prompts(4, seed=22), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                 use_tqdm=False)
    assert eng.stats()["spec_decode"]["verify_graph_steps"] > 0
    assert len(seen) > 20
    assert all(last == first for last, first in seen), seen[:10]

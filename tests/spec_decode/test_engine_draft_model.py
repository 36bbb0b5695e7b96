"""Engine with a draft-model proposer: greedy identity with non-speculative decoding; the target as
its own draft accepts (nearly) everything, which checks the draft KV bookkeeping through chunked
prefill, prefix hits and preemption; nothing leaked."""

from __future__ import annotations

import pytest

from hwkv.engine.engine import Engine
from hwkv.sampling_params import SamplingParams

from .test_engine_ngram import GREEDY, _prompts, _run, speculate_like_plain

CASES = {
    "default": {},
    "chunked_small_budget": {"max_num_batched_tokens": 9, "long_prefill_token_threshold": 6},
    "preemption_tiny_pool": {"num_kv_blocks": 26, "max_num_seqs": 6},
}


@pytest.mark.parametrize("case", list(CASES))
def test_target_as_draft_accepts_everything(tiny_model: str, case: str) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": tiny_model}
    eng = speculate_like_plain(tiny_model, _prompts(seed=11), spec, **CASES[case])
    st = eng.stats()["spec_decode"]
    assert st["draft_tokens"] > 0 and st["acceptance_rate"] > 0.97, st
    if case == "preemption_tiny_pool":
        assert eng.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("case", ["default", "preemption_tiny_pool"])
def test_small_draft_greedy_identity(tiny_model: str, tiny_draft: str, case: str) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_draft}
    eng = speculate_like_plain(tiny_model, _prompts(seed=12), spec, **CASES[case])
    assert eng.stats()["spec_decode"]["draft_tokens"] > 0


def test_sampled_seeded_reproducible(tiny_model: str) -> None:
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_model}
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True)
    prompts = _prompts(3, seed=13)
    a, eng = _run(tiny_model, prompts, params, spec)
    b, _ = _run(tiny_model, prompts[1:2], params, spec)
    assert a[1].token_ids == b[0].token_ids
    assert eng.stats()["spec_decode"]["accepted_tokens"] > 0


def test_vocab_mismatch_refused(tiny_model: str, tmp_path) -> None:
    from hwkv.model.tiny import write_tiny_model

    other = write_tiny_model(tmp_path / "v", vocab_size=384, num_layers=1, tokenizer=False)
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4,
               speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": str(other)})


def test_draft_steps_through_the_graph_path(tiny_model: str, tiny_draft: str) -> None:
    """The draft's one-token steps run from static graph buffers (here the eager emulation of the
    graph path, as on a backend that captures graphs); outputs unchanged."""
    prompts = _prompts(seed=14)
    base, _ = _run(tiny_model, prompts, GREEDY)
    for draft in (tiny_model, tiny_draft):
        eng = Engine(tiny_model, num_kv_blocks=96, block_size=4,
                     speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": draft})
        eng.runner.enable_graphs(8, use_graphs=False)
        outs = eng.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in base]
        assert eng.proposer.num_graph_steps > 0
        assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache.spec.num_blocks
        if draft == tiny_model:
            assert eng.stats()["spec_decode"]["acceptance_rate"] > 0.97


def test_draft_takes_the_backends_decode_ops_where_they_serve_it(tiny_model: str, tiny_draft: str) -> None:
    eng = Engine(tiny_model, num_kv_blocks=16, block_size=4,
                 speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": tiny_draft})

    class Ops:  # stands in for a backend's DecodeOps: only validate() is consulted here
        def __init__(self, reasons):
            self.reasons, self.use_up_to = reasons, 8

        def validate(self, *args):
            return self.reasons

    ok, bad = Ops([]), Ops(["head_dim 16 unsupported"])
    eng.proposer.set_decode_ops(ok)
    assert eng.proposer.model.decode_ops is ok
    eng.proposer.set_decode_ops(bad)
    assert eng.proposer.model.decode_ops is None


def test_catch_up_in_pieces(tiny_model: str, monkeypatch) -> None:
    """A draft catching up on a long sequence does it in bounded pieces; nothing changes."""
    from hwkv.spec_decode import draft_model

    monkeypatch.setattr(draft_model, "CATCH_UP_CHUNK", 3)
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": tiny_model}
    eng = speculate_like_plain(tiny_model, _prompts(seed=15), spec)
    assert eng.stats()["spec_decode"]["acceptance_rate"] > 0.97

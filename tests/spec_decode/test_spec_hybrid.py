"""Speculative decoding (ngram and a draft model) with a sliding-window target: the verify step's
multi-token queries attend through the window, tokens identical to non-speculative decoding."""

from __future__ import annotations

import pytest

from hwkv.model.tiny import write_tiny_model

from .test_engine_ngram import GREEDY, _prompts, _run


@pytest.fixture(scope="module")
def windowed_target(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("spec-hybrid") / "target", arch="mistral", vocab_size=512,
                                sliding_window=8, tokenizer=False))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_windowed_target_greedy_identity(windowed_target: str, method: str) -> None:
    prompts = _prompts(seed=13)
    base, _ = _run(windowed_target, prompts, GREEDY)
    spec = ({"method": "draft_model", "num_speculative_tokens": 3, "model": windowed_target} if method == "draft_model"
            else {"method": "ngram", "num_speculative_tokens": 3})
    outs, eng = _run(windowed_target, prompts, GREEDY, spec)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    st = eng.stats()["spec_decode"]
    assert st["draft_tokens"] > 0
    if method == "draft_model":  # the target as its own draft: the window is applied the same on both sides
        assert st["acceptance_rate"] > 0.97, st

"""Build the runner and proposer an ``Engine(speculative_config=...)`` asks for."""

from __future__ import annotations

from typing import Any

from hwkv.spec_decode.config import SpeculativeConfig


def make_proposer(cfg: SpeculativeConfig, engine: Any) -> Any:
    if cfg.method == "ngram":
        from hwkv.spec_decode.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.method == "draft_model":
        from hwkv.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer.load(cfg, engine)
    from hwkv.spec_decode.eagle import EagleProposer

    return EagleProposer.load(cfg, engine)

"""Build the proposer an ``Engine(speculative_config=...)`` asks for (:mod:`hwkv.spec_decode.proposer`)."""

from __future__ import annotations

import importlib

from hwkv.spec_decode.config import METHODS, SpeculativeConfig
from hwkv.spec_decode.proposer import Proposer, ProposerTarget


def make_proposer(cfg: SpeculativeConfig, target: ProposerTarget) -> Proposer:
    module, _, name = METHODS[cfg.method].partition(":")
    return getattr(importlib.import_module(module), name).load(cfg, target)

"""Speculative decoding: exact rejection sampling (``rejection``), proposers (``ngram``,
``draft_model``, ``eagle``) and the runner step that verifies and proposes (``runner``)."""

from hwkv.engine.spec_config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]

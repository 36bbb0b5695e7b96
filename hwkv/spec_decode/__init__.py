"""Speculative decoding: exact rejection sampling (``rejection``), proposers (``ngram``,
``draft_model``, ``eagle``) and the runner step that verifies and proposes (``runner``)."""

from hwkv.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]

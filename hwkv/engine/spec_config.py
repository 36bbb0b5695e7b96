"""The engine's speculative-decoding option group: ``Engine(speculative_config={...})`` validated once
(vLLM's option names), and how the engine finds what implements it - by name, as it finds backends
and connectors: each method's proposer class (``METHODS``) and the runner that verifies drafts
(``SPEC_RUNNER``) live in :mod:`hwkv.spec_decode`, which imports the engine, never the other way.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

# method -> its Proposer class ("package.module:Class", imported when an engine builds it): a new
# proposer is its module and its line here
METHODS = {
    "ngram": "hwkv.spec_decode.ngram:NgramProposer",
    "draft_model": "hwkv.spec_decode.draft_model:DraftModelProposer",
    "eagle": "hwkv.spec_decode.eagle:EagleProposer",
    "eagle3": "hwkv.spec_decode.eagle:EagleProposer",
}
MAX_SPEC_TOKENS = 32
SPEC_RUNNER = "hwkv.spec_decode.runner:SpecModelRunner"  # the model runner of a speculating engine


@dataclass(frozen=True)
class ProposerTarget:
    """What a proposer is built from."""

    model: Any  # the target model (weights on the device): its dtype, embedding, LM head, config
    model_config: Any  # hwkv.model.config.ModelConfig of the target
    backend: Any  # the engine's Backend (a draft model loads and allocates on it)


def _named(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def make_proposer(cfg: SpeculativeConfig, target: ProposerTarget) -> Any:
    """The :class:`hwkv.spec_decode.proposer.Proposer` ``cfg.method`` names, loaded on ``target``."""
    return _named(METHODS[cfg.method]).load(cfg, target)


def spec_runner() -> type:
    """The model runner class of a speculating engine (:class:`hwkv.spec_decode.runner.SpecModelRunner`)."""
    return _named(SPEC_RUNNER)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``"ngram"`` (prompt lookup, no model), ``"draft_model"`` (a smaller model of the
    target's family and vocabulary at ``model``) or ``"eagle"``/``"eagle3"`` (an EAGLE head at
    ``model``). ``num_speculative_tokens`` k drafts per request per step. n-gram matches the longest
    suffix of ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    @property
    def needs_model(self) -> bool:
        return self.method != "ngram"

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots beyond the scheduled tokens a step must hold: a model proposer writes its own
        KV for the drafts it feeds back (n-gram writes none)."""
        return self.num_speculative_tokens if self.needs_model else 0

    @classmethod
    def parse(cls, cfg: Any) -> SpeculativeConfig | None:
        """``None`` / a dict / a SpeculativeConfig → a validated config; ``ValueError`` naming the
        bad key and what is allowed."""
        if cfg is None or isinstance(cfg, SpeculativeConfig):
            return cfg
        if isinstance(cfg, str):  # `hwkv serve --speculative-config '{"method": ...}'`
            try:
                cfg = json.loads(cfg)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not a JSON object ({e}): {cfg[:80]!r}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {type(cfg).__name__}")
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max"}
        extra = sorted(set(cfg) - known)
        if extra:
            raise ValueError(f"speculative_config has unknown keys {extra} (allowed: {sorted(known)})")
        method = cfg.get("method")
        if method not in METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {list(METHODS)}, got {method!r}")
        k = cfg.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculative_config['num_speculative_tokens'] must be an int in "
                             f"[1, {MAX_SPEC_TOKENS}], got {k!r}")
        lo, hi = cfg.get("prompt_lookup_min", 1), cfg.get("prompt_lookup_max", 4)
        if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
            raise ValueError(f"speculative_config prompt_lookup_min/max must be ints with 1 <= min <= max, "
                             f"got {lo!r}/{hi!r}")
        model = cfg.get("model")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config['model'] is not used by method 'ngram' (allowed: leave it out)")
        if method != "ngram" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config['model'] must name a model directory for method {method!r}, "
                             f"got {model!r}")
        return cls(method, k, model, lo, hi)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)

"""Model registry: a Hugging Face ``architectures`` name → the family that serves it.

A family is one module that defines its config adapter and model class and ends with
``register(ModelFamily(...))``; adding a family means adding that file and its module name to
``BUILTIN_FAMILIES`` (or, outside this package, importing a module that calls :func:`register`
before loading). Built-in families are imported on the first lookup, so importing the registry
costs nothing.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hwkv.model.fields import ConfigFields

BUILTIN_FAMILIES = ("hwkv.model.llama", "hwkv.model.qwen3", "hwkv.model.qwen3_moe", "hwkv.model.gemma2",
                     "hwkv.model.gemma3", "hwkv.model.gpt_oss")

# (validated config.json reader, the common fields already read) -> the family's ModelConfig fields
ConfigAdapter = Callable[[ConfigFields, dict[str, Any]], dict[str, Any]]


def no_adaptation(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class ModelFamily:
    """How one family of checkpoints is served.

    ``architectures``: the HF class names it accepts. ``adapt_config(fields, common)`` reads and
    validates the family's own config.json keys and returns :class:`ModelConfig` fields overriding
    or adding to ``common`` (``qkv_bias``, ``o_bias``, ``sliding_window``, ``extra``); it raises
    :class:`ModelLoadError` through ``fields``. ``model_class(config, attention, device, dtype,
    max_positions)`` builds the model; its ``weight_slots()`` is the weight-name map (every HF
    tensor name of a complete checkpoint → the parameter view it fills). ``fused_decode``: ``None``
    when the backend's fused :class:`DecodeOps` compute this family's layers; otherwise why they
    cannot — the model then always runs its plain forward.
    """

    name: str
    architectures: tuple[str, ...]
    model_class: type
    adapt_config: ConfigAdapter = no_adaptation
    fused_decode: str | None = None
    activations: tuple[str, ...] = ("silu",)  # the hidden_act values the family computes
    per_layer_rope: bool = False  # the family reads per-layer-type rope_parameters itself (Gemma 3)


_FAMILIES: dict[str, ModelFamily] = {}
_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family``; a name already registered by another family raises ``ValueError``."""
    for arch in family.architectures:
        other = _FAMILIES.get(arch)
        if other is not None and other.name != family.name:
            raise ValueError(f"architecture {arch!r} is already served by model family {other.name!r}")
    for arch in family.architectures:
        _FAMILIES[arch] = family
    return family


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        for module in BUILTIN_FAMILIES:
            importlib.import_module(module)
        _loaded = True  # only once all imported: a failed import is retried (and raises) next time


def supported_architectures() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_FAMILIES))


def family_of(architecture: str) -> ModelFamily:
    """The family serving ``architecture``; ``KeyError`` if none does."""
    _load_builtin()
    return _FAMILIES[architecture]


def find_family(architectures: list[str]) -> tuple[str, ModelFamily] | None:
    """The first of ``architectures`` a registered family serves, with that family."""
    _load_builtin()
    for arch in architectures:
        if arch in _FAMILIES:
            return arch, _FAMILIES[arch]
    return None

"""ModelConfig: the subset of a Hugging Face ``config.json`` the model families need, validated.

The fields every decoder shares are read here; a family's own keys are read by its config adapter
(:class:`hwkv.model.registry.ModelFamily`) into ``qkv_bias``/``o_bias``/``sliding_window``/``extra``.

Accepts config files as real checkpoints carry them: the older ``rope_theta`` + ``rope_scaling``
keys (``type`` or ``rope_type``) and the transformers-5 ``rope_parameters`` dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hwkv.interfaces.layout import KVCacheSpec
from hwkv.model.fields import ConfigFields, ModelLoadError
from hwkv.model.gguf_file import find_gguf, open_gguf
from hwkv.model.registry import find_family, supported_architectures

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """``"bfloat16"``/``"bf16"``/``torch.bfloat16`` → ``torch.bfloat16``; ``None``/``"auto"`` → ``None``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key == "auto":
            return None
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"{what} {value!r} is not supported (allowed: float32, bfloat16, float16, auto)")


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # normalised: always has "rope_type"; None = default rope
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype | None = None
    sliding_window: int | None = None  # None when the model attends to its full context
    # "sliding_attention" / "full_attention" per layer (HF's layer_types); None: every layer windowed
    # when sliding_window is set
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    path: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific, validated by its adapter

    @property
    def max_model_len(self) -> int:
        """Longest sequence served by default. Sliding-window layers attend through their window
        (``AttentionImpl.window``); their KV is kept for the whole context for now (docs/hybrid-models.md)."""
        return self.max_position_embeddings

    def window_of(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` (``None``: full attention)."""
        if not self.sliding_window:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_features(self) -> tuple[str, ...]:
        """What the layers need of the attention backend (``Capabilities.attention_features``)."""
        windowed = any(self.window_of(i) for i in range(self.num_layers))
        return ("sliding_window",) if windowed else ()

    def check_max_model_len(self, max_model_len: int) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")

    def kv_cache_spec(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVCacheSpec:
        return KVCacheSpec(
            num_layers=self.num_layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=dtype or self.dtype or torch.float32,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        dt = self.dtype or torch.float32
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dt.itemsize

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """From an HF directory's config.json, or a GGUF checkpoint's metadata (a ``.gguf`` file or a
        directory holding one and no config.json; :mod:`hwkv.model.gguf_file`)."""
        path = Path(path)
        if (file := find_gguf(path)) is not None:
            return cls.from_dict(open_gguf(file).config_dict(), source=str(file))
        if not path.is_dir():
            what = "file" if path.suffix == ".gguf" else "model directory"
            raise ModelLoadError(f"{path}: {what} not found")
        return cls.from_dict(read_json(path / "config.json"), source=str(path / "config.json"))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Parse and validate ``cfg``; every malformed field raises :class:`ModelLoadError` naming
        ``source``, the field, its value and the allowed range."""
        f = ConfigFields(cfg, source)
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise f.fail("architectures", archs, "a list of architecture names")
        found = find_family(archs)
        if found is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r} "
                f"(supported: {', '.join(supported_architectures())})"
            )
        arch, family = found
        act = f.string("hidden_act", None) or family.activations[0]
        if act not in family.activations:
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (allowed: "
                                 f"{', '.join(family.activations)})")
        hidden, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
        kv_heads = f.integer("num_key_value_heads", heads, hi=heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads} "
                f"(allowed: a divisor of {heads})"
            )
        if f.raw("head_dim") is None and hidden % heads:
            raise ModelLoadError(
                f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads {heads} and no head_dim "
                "is given (allowed: set head_dim, or hidden_size divisible by num_attention_heads)"
            )
        head_dim = f.integer("head_dim", hidden // heads, lo=2)
        if head_dim % 2:  # RoPE rotates pairs of dimensions
            raise f.fail("head_dim", head_dim, "an even integer >= 2")
        max_pos = f.integer("max_position_embeddings", 2048)
        theta, scaling = _parse_rope(f, max_pos, per_layer=family.per_layer_rope)
        attn_bias = f.flag("attention_bias", False)
        dtype_s = f.string("dtype", None) or f.string("torch_dtype", None)
        try:
            dtype = parse_dtype(dtype_s, "dtype") if dtype_s else None
        except ValueError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        bos = f.token_ids("bos_token_id")
        if len(bos) > 1:
            raise f.fail("bos_token_id", cfg["bos_token_id"], "null or an integer >= 0")
        fields: dict[str, Any] = dict(
            architecture=arch,
            model_type=f.string("model_type", ""),
            vocab_size=f.integer("vocab_size"),
            hidden_size=hidden,
            intermediate_size=f.integer("intermediate_size"),
            num_layers=f.integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.number("rms_norm_eps", 1e-6, gt=0),
            max_position_embeddings=max_pos,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=f.flag("tie_word_embeddings", False),
            qkv_bias=attn_bias,
            o_bias=attn_bias,
            mlp_bias=f.flag("mlp_bias", False),
            dtype=dtype,
            sliding_window=f.integer("sliding_window", None),
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=f.token_ids("eos_token_id"),
            path=str(Path(source).parent),
        )
        fields.update(family.adapt_config(f, fields))
        return cls(**fields)


def windowed_if_enabled(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    """Qwen-style configs carry a ``sliding_window`` size but use it only with ``use_sliding_window``,
    and then (as transformers) only in layers ``>= max_window_layers`` (default 28)."""
    if not f.flag("use_sliding_window", False) or not common.get("sliding_window"):
        return {"sliding_window": None}
    first = f.integer("max_window_layers", 28, lo=0)
    return {"layer_types": tuple("sliding_attention" if i >= first else "full_attention"
                                 for i in range(common["num_layers"]))}


# Per rope type: required keys, then optional ones, as (key, kind, bound) — kind "num": a finite
# number > bound ("num>=": >= bound), "bool": true/false.
_ROPE_KEYS: dict[str, tuple[tuple[tuple[str, str, float], ...], tuple[tuple[str, str, float], ...]]] = {
    "default": ((), ()),
    "linear": ((("factor", "num>=", 1.0),), ()),
    "llama3": ((("factor", "num>=", 1.0), ("low_freq_factor", "num", 0.0), ("high_freq_factor", "num", 0.0)), ()),
    "yarn": ((), (("factor", "num>=", 1.0), ("attention_factor", "num", 0.0), ("mscale", "num>=", 0.0),
                  ("mscale_all_dim", "num>=", 0.0), ("beta_fast", "num", 0.0), ("beta_slow", "num", 0.0),
                  ("truncate", "bool", 0.0))),
}


def _parse_rope(f: ConfigFields, max_pos: int, per_layer: bool = False) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from either the ``rope_parameters`` or the ``rope_scaling`` form,
    every value validated. ``per_layer``: the family reads per-layer-type ``rope_parameters`` (Gemma 3)
    itself; the common fields take the ``full_attention`` entry."""
    key = "rope_parameters" if f.raw("rope_parameters") else "rope_scaling"
    params = f.raw(key, {})
    if not isinstance(params, dict):
        raise f.fail(key, params, "an object or null")
    if per_layer and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if any(isinstance(v, dict) for v in params.values()):
        raise f.error("per-layer-type rope_parameters are not supported")
    p = f.nested(key, params)
    theta = p.number("rope_theta", None, gt=0) if params.get("rope_theta") is not None else \
        f.number("rope_theta", 10000.0, gt=0)
    rope_type = p.string("rope_type", None) or p.string("type", None) or "default"
    for where in (f, p):
        if where.raw("partial_rotary_factor", 1.0) != 1.0:
            raise where.fail("partial_rotary_factor", where.raw("partial_rotary_factor"), "1 (partial RoPE is "
                             "not supported)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise f.error(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "'dynamic' NTK scaling depends on the sequence length and is refused rather than silently ignored"
        )
    if rope_type == "default":
        return theta, None
    out: dict[str, Any] = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")}
    required, optional = _ROPE_KEYS[rope_type]
    for name, kind, bound in required + optional:
        if params.get(name) is None:
            if any(name == r[0] for r in required):
                raise f.error(f"rope type {rope_type!r} needs {name!r}")
            continue
        if kind == "bool":
            out[name] = p.flag(name)
        else:
            out[name] = p.number(name, gt=None if kind == "num>=" else bound, ge=bound if kind == "num>=" else None)
    if rope_type == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise p.fail("high_freq_factor", out["high_freq_factor"],
                     f"a number > low_freq_factor {out['low_freq_factor']:g}")
    if rope_type in ("llama3", "yarn"):
        top = f.integer("original_max_position_embeddings", None)  # transformers: the top-level key wins
        orig = top if top is not None else p.integer("original_max_position_embeddings", None)
        out["original_max_position_embeddings"] = max_pos if orig is None else orig
    return theta, {"rope_type": rope_type, **out}

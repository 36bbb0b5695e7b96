"""ModelConfig: the subset of a Hugging Face ``config.json`` the Llama-family forward needs.

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

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file and what is expected."""


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


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


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
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    path: str = ""

    @property
    def max_model_len(self) -> int:
        """Longest sequence served by default: sliding-window attention is not implemented, so a
        windowed model is capped at its window (where full attention equals windowed attention)."""
        n = self.max_position_embeddings
        return min(n, self.sliding_window) if self.sliding_window else n

    def check_max_model_len(self, max_model_len: int) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        if self.sliding_window and max_model_len > self.sliding_window:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds sliding_window {self.sliding_window} of {self.path}; "
                f"sliding-window attention is not supported (allowed: max_model_len <= {self.sliding_window})"
            )

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
        path = Path(path)
        if not path.is_dir():
            raise ModelLoadError(f"{path}: model directory not found")
        return cls.from_dict(read_json(path / "config.json"), source=str(path / "config.json"))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise ModelLoadError(f"{source}: required key {key!r} is missing")
            return cfg[key]

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act {act!r} is not supported (allowed: silu)")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        theta, scaling = _parse_rope(cfg, source)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            window = None  # Qwen2 carries a window size but only uses it with use_sliding_window
        attn_bias = bool(cfg.get("attention_bias", False))
        dtype_s = cfg.get("dtype") or cfg.get("torch_dtype")
        try:
            dtype = parse_dtype(dtype_s, "dtype") if dtype_s else None
        except ValueError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        return cls(
            architecture=arch,
            model_type=str(cfg.get("model_type", "")),
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attn_bias,
            o_bias=attn_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            dtype=dtype,
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
            path=str(Path(source).parent),
        )


def _parse_rope(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from either the ``rope_parameters`` or the ``rope_scaling`` form."""
    params = cfg.get("rope_parameters")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{source}: per-layer-type rope_parameters are not supported")
    params = dict(params or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
            "'dynamic' NTK scaling depends on the sequence length and is refused rather than silently ignored"
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        orig = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(orig or cfg.get("max_position_embeddings", 2048))
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ()}
    for key in required[rope_type]:
        if params.get(key) is None:
            raise ModelLoadError(f"{source}: rope type {rope_type!r} needs {key!r}")
    return theta, {"rope_type": rope_type, **params}

"""Capabilities: what a backend declares it supports.

Capabilities are the *only* source of NOT_SUPPORTED in conformance: a case the backend declares
is tested; a case it excludes is reported NOT_SUPPORTED with the reason `validate` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hwkv.interfaces.kv_quant import is_quantized, kv_dtype_name
from hwkv.interfaces.layout import KVCacheSpec, KVLayoutKind

# per-layer attention parameters a model may need (AttentionImpl.window / softcap / sinks)
ATTENTION_FEATURES = ("sliding_window", "logit_softcap", "attention_sinks")


class NotSupported(RuntimeError):
    """The backend does not support a requested feature; the message names the capability."""


@dataclass(frozen=True)
class Capabilities:
    """Frozen declaration of what a backend supports.

    Block sizes: either an explicit tuple ``block_sizes`` (Ascend: ``(128,)``) or every multiple of
    ``block_size_multiple`` up to ``max_block_size`` (CUDA: multiples of 16).

    ``kv_cache_dtypes``: the ``Engine(kv_cache_dtype=...)`` values whose KV the attention writes and
    reads (:mod:`hwkv.interfaces.kv_quant`): ``"auto"`` (the model's dtype, one of ``dtypes``) and
    quantised ones by canonical name (``"fp8_e4m3"``: float8 e4m3 with float32 per-head scales);
    ``kv_cache_dtype_reason`` says why one is missing (shown in the refusal).

    ``attention_features``: the per-layer attention parameters of :class:`AttentionImpl` the backend
    computes exactly (:data:`ATTENTION_FEATURES`: ``"sliding_window"``, ``"logit_softcap"``,
    ``"attention_sinks"``); a model that needs one missing here is refused by name, with
    ``attention_features_reason``.
    """

    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    head_sizes: tuple[int, ...] | None = None  # None: any head size
    block_sizes: tuple[int, ...] | None = None
    block_size_multiple: int = 1
    max_block_size: int = 256
    default_block_size: int = 16
    kv_layouts: tuple[KVLayoutKind, ...] = (KVLayoutKind.PER_LAYER,)
    transfer_protocols: tuple[str, ...] = ()
    transfer_reason: str = ""  # why no transfer protocol is available, when empty
    graph_capture: bool = False
    max_gqa_ratio: int = 64
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    kv_cache_dtype_reason: str = ""
    attention_features: tuple[str, ...] = ()
    attention_features_reason: str = ""
    extras: dict[str, str] = field(default_factory=dict)

    def supports_block_size(self, block_size: int) -> bool:
        if block_size < 1 or block_size > self.max_block_size:
            return False
        if self.block_sizes is not None:
            return block_size in self.block_sizes
        return block_size % self.block_size_multiple == 0

    def supports_kv_cache_dtype(self, dtype: torch.dtype) -> bool:
        """Whether KV stored as ``dtype`` is written and read (the model's dtypes always are)."""
        return kv_dtype_name(dtype) in self.kv_cache_dtypes if is_quantized(dtype) else dtype in self.dtypes

    def describe_block_sizes(self) -> str:
        if self.block_sizes is not None:
            return "exactly " + " or ".join(str(b) for b in self.block_sizes)
        if self.block_size_multiple == 1:
            return f"1..{self.max_block_size}"
        return f"multiples of {self.block_size_multiple} up to {self.max_block_size}"

    def test_block_sizes(self) -> tuple[int, ...]:
        """The block sizes conformance exercises: every declared one, or a spread of multiples."""
        if self.block_sizes is not None:
            return self.block_sizes
        cands = (1, 8, 16, 32, 64, 128)
        return tuple(b for b in cands if self.supports_block_size(b))

    def validate(
        self,
        spec: KVCacheSpec,
        num_heads: int | None = None,
        layout: KVLayoutKind | None = None,
        transfer_protocol: str | None = None,
        model_dtype: torch.dtype | None = None,
        attention_features: tuple[str, ...] = (),
    ) -> list[str]:
        """Reasons this configuration is unsupported; an empty list means supported. A quantised
        ``spec.dtype`` (fp8 KV) is checked against ``kv_cache_dtypes``, and ``model_dtype`` (the
        activations', when given) against ``dtypes``; ``attention_features`` (what the model's
        layers need, :data:`ATTENTION_FEATURES`) against the declared ones."""
        reasons: list[str] = []
        allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
        if is_quantized(spec.dtype):
            if not self.supports_kv_cache_dtype(spec.dtype):
                why = f"; {self.kv_cache_dtype_reason}" if self.kv_cache_dtype_reason else ""
                reasons.append(f"kv_cache_dtype {kv_dtype_name(spec.dtype)} not supported (allowed: "
                               f"{', '.join(self.kv_cache_dtypes)}){why}")
        elif spec.dtype not in self.dtypes:
            reasons.append(f"dtype {str(spec.dtype).removeprefix('torch.')} not supported (allowed: {allowed})")
        if model_dtype is not None and model_dtype != spec.dtype and model_dtype not in self.dtypes:
            reasons.append(f"dtype {str(model_dtype).removeprefix('torch.')} not supported (allowed: {allowed})")
        if not self.supports_block_size(spec.block_size):
            reasons.append(f"block_size {spec.block_size} not supported (allowed: {self.describe_block_sizes()})")
        if self.head_sizes is not None and spec.head_size not in self.head_sizes:
            reasons.append(f"head_size {spec.head_size} not supported (allowed: {list(self.head_sizes)})")
        if num_heads is not None:
            if num_heads % spec.num_kv_heads:
                reasons.append(f"num_heads {num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
            elif num_heads // spec.num_kv_heads > self.max_gqa_ratio:
                reasons.append(f"GQA ratio {num_heads // spec.num_kv_heads} exceeds {self.max_gqa_ratio}")
        if layout is not None and layout not in self.kv_layouts:
            reasons.append(f"KV layout {layout.value} not supported (allowed: {[k.value for k in self.kv_layouts]})")
        if transfer_protocol is not None and transfer_protocol not in self.transfer_protocols:
            why = f"; {self.transfer_reason}" if self.transfer_reason else ""
            reasons.append(
                f"transfer protocol {transfer_protocol!r} not supported (allowed: {list(self.transfer_protocols)}){why}"
            )
        for feat in attention_features:
            if feat not in ATTENTION_FEATURES:
                reasons.append(f"unknown attention feature {feat!r} (known: {', '.join(ATTENTION_FEATURES)})")
            elif feat not in self.attention_features:
                why = f"; {self.attention_features_reason}" if self.attention_features_reason else ""
                have = ", ".join(self.attention_features) or "none"
                reasons.append(f"attention feature {feat} not supported (supported: {have}){why}")
        return reasons

    def summary(self) -> str:
        dt = ",".join(str(d).removeprefix("torch.") for d in self.dtypes)
        tp = ",".join(self.transfer_protocols) or "none"
        heads = list(self.head_sizes) if self.head_sizes else "any"
        layouts = "/".join(k.value for k in self.kv_layouts)
        graphs = "yes" if self.graph_capture else "no"
        return (
            f"dtypes={dt} kv={','.join(self.kv_cache_dtypes)} block={self.describe_block_sizes()} heads={heads} "
            f"layout={layouts} transfer={tp} graphs={graphs}"
        )

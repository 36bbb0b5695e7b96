"""Quantised KV cache: the names users pass, the storage dtype, and the reference (de)quantisation.

``kv_cache_dtype="fp8"`` (alias ``"fp8_e4m3"``) stores K and V as float8 e4m3 (``torch.float8_e4m3fn``,
finite, max 448) with float32 dequantisation scales, as vLLM's ``fp8`` KV cache: writing stores
``clamp(x / scale, -448, 448)`` rounded to nearest-even, reading computes ``q * scale``. Scales are
per layer and per KV head (``KVCache.scales``, ``[num_layers, 2, H_kv]``: K then V); per-tensor scales
(vLLM's ``k_scale`` / ``v_scale``) are the case where every head of a layer holds the same value.
They default to 1.0 (vLLM's default when a checkpoint carries none); a checkpoint's ``k_scale`` /
``v_scale`` tensors are used when present, and ``Engine(kv_cache_scales=...)`` sets calibrated ones.
``"auto"`` stores KV in the model's dtype. These functions are the oracle every
backend's kernels are compared against (conformance, ``docs/fp8-kv-cache.md``).

Page layout: a quantised cache's K pages are token-major like a 16-bit cache's (``[block_size, H_kv, D]``
per block), its V pages are stored **transposed**, ``[H_kv, D, block_size]`` in the same bytes: each
head's codes key-contiguous per dimension, so the P.V product reads V with the keys (its reduction
dim) contiguous, as an 8-bit operand needs (:func:`v_token_view` is the token-major view of them).
"""

from __future__ import annotations

from typing import Any

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# user-facing names -> storage dtype (None: the model's dtype)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": FP8_E4M3, "fp8_e4m3": FP8_E4M3}
QUANTIZED = (FP8_E4M3,)


def kv_storage_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype KV is stored in for ``kv_cache_dtype=name`` (``ValueError`` naming the allowed)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED


def v_token_view(v_pages: torch.Tensor) -> torch.Tensor:
    """The V half of a quantised cache, ``[num_blocks, block_size, H_kv, D]`` by shape but stored
    ``[H_kv, D, block_size]`` per block (module docstring), as a token-major view ``[num_blocks,
    block_size, H_kv, D]`` of the same memory: ``view[b, t, h, d]`` is the code of token ``t``, head ``h``,
    dim ``d``. Reads and (indexed) writes through it land on the transposed bytes."""
    nb, bs, hkv, d = v_pages.shape
    if v_pages.stride()[1:] != (hkv * d, d, 1):
        raise ValueError(f"V pages must be contiguous within a block, got strides {v_pages.stride()}")
    return v_pages.as_strided((nb, bs, hkv, d), (v_pages.stride(0), 1, d * bs, bs))


def kv_dtype_name(dtype: torch.dtype) -> str:
    """Canonical name of a KV storage dtype: ``"fp8_e4m3"`` or the torch name (``"bfloat16"``): what
    capabilities declare and what pool keys / P/D handshakes compare."""
    return "fp8_e4m3" if dtype == FP8_E4M3 else str(dtype).removeprefix("torch.")


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = FP8_E4M3) -> torch.Tensor:
    """``x`` ``[..., H_kv, D]`` to ``dtype`` with per-head ``scale`` ``[H_kv]`` (or a float): fp32 division,
    saturated to the finite range, rounded to nearest-even (what the GPU's ``cvt.rn.satfinite`` does)."""
    s = scale[:, None] if isinstance(scale, torch.Tensor) else scale
    return (x.float() / s).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q`` ``[..., H_kv, D]`` back to ``dtype``: ``q * scale`` in float32 (float64 kept for float64)."""
    s = scale[:, None] if isinstance(scale, torch.Tensor) else scale
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (q.to(acc) * (s.to(acc) if isinstance(s, torch.Tensor) else s)).to(dtype)


def parse_scales(value: Any, num_layers: int, num_kv_heads: int) -> torch.Tensor:
    """``Engine(kv_cache_scales=...)`` as a float32 ``[num_layers, 2, H_kv]`` tensor. Accepted: a float
    (every layer, K and V), a pair ``(k, v)``, a list of ``num_layers`` pairs (per tensor, vLLM's
    ``k_scale``/``v_scale``), or ``[num_layers, 2, H_kv]`` nested lists / a tensor (per head). Every
    scale must be finite and > 0 (``ValueError`` naming what was wrong). A string is read as JSON (CLI)."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_cache_scales is not valid JSON ({e}): {value!r}") from None
    try:
        t = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"kv_cache_scales must be numbers (a float, [k, v], per layer or per head), got {value!r}"
                         ) from e
    shape = tuple(t.shape)
    if t.dim() == 0:
        t = t.expand(num_layers, 2, num_kv_heads)
    elif shape == (2,):
        t = t[None, :, None].expand(num_layers, 2, num_kv_heads)
    elif shape == (num_layers, 2):
        t = t[:, :, None].expand(num_layers, 2, num_kv_heads)
    elif shape != (num_layers, 2, num_kv_heads):
        raise ValueError(f"kv_cache_scales has shape {list(shape)}; allowed: a float, [k, v], "
                         f"[{num_layers}, 2] (per layer) or [{num_layers}, 2, {num_kv_heads}] (per layer and KV head)")
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError("kv_cache_scales must all be finite and > 0")
    return t.contiguous()


def shard_scales(value: Any, num_layers: int, num_kv_heads: int, head_start: int, local_heads: int) -> torch.Tensor:
    """:func:`parse_scales` over the checkpoint's ``num_kv_heads``, cut to one tensor-parallel rank's KV heads
    ``[head_start, head_start + local_heads)`` (a rank holding a replicated head gets that head's scales)."""
    return parse_scales(value, num_layers, num_kv_heads)[:, :, head_start:head_start + local_heads].contiguous()


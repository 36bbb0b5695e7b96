"""KV-write mutants: ``write_kv`` of the reference with one realistic mistake."""

from __future__ import annotations

import math
from typing import Any

import torch

from conformance.mutants.base import mutant
from hwkv.interfaces import KVLayoutKind
from hwkv.reference import ReferenceAttentionImpl
from hwkv.reference.attention import split_kv, write_kv

FIRST = ("test_kv_write.py::test_write_kv[float32-bs16-hd64",)
PROD = ("test_kv_write.py::test_write_kv[float32-bs16-hd64-production",)


def _impl(name: str, write: Any) -> type[ReferenceAttentionImpl]:
    def write_kv_(self: Any, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
        self._check_cache(layer_kv)
        write(key, value, layer_kv, slots)

    return type(f"KVWrite_{name}", (ReferenceAttentionImpl,), {"write_kv": write_kv_})


def _scatter(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor, bs: int | None = None) -> None:
    """Plain scatter of rows with slot >= 0 (``bs`` overrides the cache's block size: a bug)."""
    k_cache, v_cache = split_kv(layer_kv)
    bs = bs or k_cache.shape[1]
    keep = slots >= 0
    s = slots[keep]
    k_cache[s // bs, s % bs] = key[: slots.numel()][keep].to(k_cache.dtype)
    v_cache[s // bs, s % bs] = value[: slots.numel()][keep].to(v_cache.dtype)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    strides = [math.prod(t.shape[i + 1 :]) for i in range(t.dim())]
    return torch.as_strided(t, t.shape, strides, t.storage_offset())


def _chunked(chunk: int, drop_partial: bool, limit: int | None = None) -> Any:
    def write(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
        n = slots.numel() if limit is None else min(slots.numel(), limit)
        end = n - n % chunk if drop_partial else n
        for a in range(0, end, chunk):
            b = min(a + chunk, end)
            write_kv(key[a:b], value[a:b], layer_kv, slots[a:b])

    return write


def _rows_from_key(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
    """BUG: the token count taken from K's rows; the slots past slot_mapping's end read as 0 (the
    zero-filled tail of a padded device buffer), so extra rows land in slot 0."""
    pad = torch.zeros(key.shape[0] - slots.numel(), dtype=slots.dtype)
    _scatter(key, value, layer_kv, torch.cat([slots, pad]))


def _minus_one_tail(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
    """BUG: the vector loop's masked tail forgets the -1 test: a padded last token is written at
    slot -1 (the cache's last slot, as a negative offset from a flat view lands)."""
    s = slots.clone()
    if s.numel() and int(s[-1]) == -1:
        s[-1] = split_kv(layer_kv)[0].shape[0] * split_kv(layer_kv)[0].shape[1] - 1
    _scatter(key, value, layer_kv, s)


def _tile_first_slot(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
    """BUG: padding decided per 16-token tile from its first slot: a tile starting with -1 is skipped
    whole (its real tokens are lost)."""
    s = slots.clone()
    for a in range(0, s.numel(), 16):
        if int(s[a]) == -1:
            s[a : a + 16] = -1
    _scatter(key, value, layer_kv, s)


def _flat_reshape(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
    """BUG: the layer's cache flattened with ``reshape`` to [slots, H, D] and scattered into: a
    contiguous per-layer tensor gives a view, a CROSS_LAYER layer (strided) a copy, so the write is lost."""
    keep = slots >= 0
    for cache, x in zip(split_kv(layer_kv), (key, value)):
        flat = cache.reshape(-1, *cache.shape[2:])
        flat[slots[keep].long()] = x[: slots.numel()][keep].to(cache.dtype)


def _sorted_slots(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
    write_kv(key, value, layer_kv, slots.sort().values)  # BUG: slots sorted (coalescing), rows not permuted


mutant("kv-drops-last-token", "kv_write", "writes slot_mapping.numel() - 1 tokens (off-by-one)", FIRST,
       impl=_impl("tail", lambda k, v, kv, s: write_kv(k[:-1], v[:-1], kv, s[:-1])))
mutant("kv-minus-one-clamped", "kv_write", "slot -1 clamped to 0 instead of skipped", FIRST,
       impl=_impl("clamp", lambda k, v, kv, s: _scatter(k, v, kv, s.clamp_min(0))))
mutant("kv-ignores-strides", "kv_write", "K/V read with contiguous strides (a fused qkv view is strided)", FIRST,
       impl=_impl("stride", lambda k, v, kv, s: write_kv(_contiguous(k), _contiguous(v), kv, s)))
mutant("kv-fp16-intermediate", "kv_write", "K/V staged through a float16 buffer before the cache", FIRST,
       impl=_impl("fp16", lambda k, v, kv, s: write_kv(k.half(), v.half(), kv, s)))
mutant("kv-block-size-16", "kv_write", "slot -> (block, offset) with a hard-coded block size of 16", FIRST,
       impl=_impl("bs16", lambda k, v, kv, s: _scatter(k, v, kv, s, bs=16)))
mutant("kv-token-limit-2048", "kv_write", "a fixed 2048-token staging buffer: tokens past it are dropped", PROD,
       impl=_impl("limit", _chunked(2048, False, limit=2048)))
mutant("kv-chunk-tail-dropped", "kv_write", "written in chunks of 256 tokens; the partial last chunk is dropped",
       PROD, impl=_impl("chunk", _chunked(256, True)))
mutant("kv-sorted-slots", "kv_write", "slots sorted for coalescing without permuting the K/V rows", FIRST,
       impl=_impl("sorted", _sorted_slots))
mutant("kv-rows-from-key", "kv_write", "token count taken from K's rows, not slot_mapping's length (a padded "
       "batch's extra rows written to slot 0)", FIRST, impl=_impl("rows", _rows_from_key))
mutant("kv-minus-one-last-token", "kv_write", "a -1 slot at the last token is written (the vector tail skips the "
       "padding test)", ("test_kv_write.py::test_write_kv[float32-bs16-hd64-minus_one_positions",),
       impl=_impl("tail1", _minus_one_tail))
mutant("kv-tile-padding-from-first-slot", "kv_write", "a 16-token tile whose first slot is -1 is skipped whole",
       ("test_kv_write.py::test_write_kv[float32-bs16-hd64-minus_one_positions",), impl=_impl("tile", _tile_first_slot))
mutant("kv-padded-rows-to-block-0", "kv_write", "a graph-padded decode batch's rows (slot -1, block table of zeros) "
       "written to block 0, which a real request owns", ("test_long_context.py::test_attention_padded_rows[float32",),
       impl=_impl("pad0", lambda k, v, kv, s: _scatter(k, v, kv, s.clamp_min(0))), caps={"graph_capture": True})
mutant("kv-cross-layer-reshape-copy", "kv_write", "the layer's cache flattened with reshape before the scatter: "
       "a CROSS_LAYER layer is strided, so the write goes to a copy", FIRST, impl=_impl("reshape", _flat_reshape),
       layout=KVLayoutKind.CROSS_LAYER)

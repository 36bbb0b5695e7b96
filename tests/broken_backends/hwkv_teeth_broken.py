"""Deliberately broken backends for tests/test_conformance_teeth.py, installed as a real plugin
distribution (entry point group ``hwkv.backends``) so they reach conformance the vendor's way.

Each is the CPU reference backend with one attention piece replaced by a naive paged attention
(:class:`NaiveImpl`) carrying exactly one bug. ``teeth-ok`` is the naive attention without a bug:
it must certify, which shows that every other backend fails because of its bug alone.
``teeth-ok`` also offers the torch reference DecodeOps, ``teeth-norope`` decode ops without RoPE.
``teeth-crosslayer`` is that same correct attention on the CROSS_LAYER KV layout (not a bug: it shows
the suite reads every layout through the layout definitions).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import pytest
import torch

from hwkv.interfaces import API_VERSION, AttentionBackend, BackendSpec, KVLayoutKind
from hwkv.model.decode_ops import TorchDecodeOps
from hwkv.plugins import hookimpl
from hwkv.reference import CpuBackend, ReferenceAttentionImpl

BUGS = ("ok", "slot", "causal", "gqa", "blockorder", "raises", "asserts", "hangs", "crosslayer", "dodges", "halfcausal",
        "norope")


class NaiveImpl(ReferenceAttentionImpl):
    bug = "ok"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        if self.bug != "slot":
            return super().write_kv(key, value, layer_kv, slot_mapping)
        k_cache, v_cache = layer_kv[:, 0], layer_kv[:, 1]
        # BUG: slot -1 is not skipped; Python indexing turns it into the cache's last slot.
        nb, bs = k_cache.shape[:2]
        blk, off = slot_mapping // bs, slot_mapping % bs
        blk = torch.where(slot_mapping < 0, nb - 1, blk)
        off = torch.where(slot_mapping < 0, bs - 1, off)
        k_cache[blk, off] = key[: slot_mapping.numel()].to(k_cache.dtype)
        v_cache[blk, off] = value[: slot_mapping.numel()].to(v_cache.dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any,
                metadata: Any) -> torch.Tensor:
        if self.bug == "raises":
            raise RuntimeError("device kernel launch failed (deliberate)")
        if self.bug == "asserts":
            assert query.is_contiguous() and False, "vendor-side assert (deliberate)"
        if self.bug == "hangs":
            time.sleep(30)
        if self.bug == "dodges":  # a backend trying to pass a declared case off as unsupported
            pytest.skip("NOT_SUPPORTED: decode is hard (deliberate)")
        k_cache, v_cache = layer_kv[:, 0], layer_kv[:, 1]
        bs, hkv = k_cache.shape[1], self.num_kv_heads
        group = self.num_heads // hkv
        qsl, sl = metadata.query_start_loc_cpu.tolist(), metadata.seq_lens_cpu.tolist()
        out = torch.zeros_like(query)
        for r, seq in enumerate(sl):
            q0, q1 = qsl[r], qsl[r + 1]
            ql, ctx = q1 - q0, seq - (q1 - q0)
            blocks = metadata.block_tables[r, : math.ceil(seq / bs)].long()
            if self.bug == "blockorder":
                blocks = blocks.sort().values  # BUG: reads the block table in ascending order
            k = k_cache[blocks].flatten(0, 1)[:seq].float()
            v = v_cache[blocks].flatten(0, 1)[:seq].float()
            heads = torch.arange(self.num_heads)
            # BUG (gqa): query head h reads KV head h % H_kv instead of h // group.
            kv_head = heads % hkv if self.bug == "gqa" else heads // group
            q = query[q0:q1].float()  # [Q, H, D]
            scores = torch.einsum("qhd,shd->hqs", q, k[:, kv_head]) * self.scale
            j = torch.arange(ql)[:, None]
            s = torch.arange(seq)[None, :]
            # BUG (causal): a multi-token chunk is masked top-left (as if it started at position 0).
            allowed = s <= j if self.bug in ("causal", "halfcausal") and ql > 1 else s <= ctx + j
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[q0:q1] = torch.einsum("hqs,shd->qhd", scores.softmax(-1), v[:, kv_head]).to(out.dtype)
        return out


class NoRopeDecodeOps(TorchDecodeOps):
    """Decode ops whose ``qkv`` rotates every token by position 0 (that is, not at all)."""

    def qkv(self, h, norm_weight, eps, weight, bias, cos, sin, positions, *rest):  # type: ignore[no-untyped-def]
        return super().qkv(h, norm_weight, eps, weight, bias, cos, sin, torch.zeros_like(positions), *rest)


def _backend_class(bug: str) -> type[CpuBackend]:
    impl = type(f"NaiveImpl_{bug}", (NaiveImpl,), {"bug": bug})

    layout = KVLayoutKind.CROSS_LAYER if bug == "crosslayer" else KVLayoutKind.PER_LAYER

    class _Attention(AttentionBackend):
        name = f"teeth-{bug}"
        kv_layout = layout

        def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> NaiveImpl:
            return impl(num_heads, head_size, num_kv_heads, scale)

    class _Backend(CpuBackend):
        name = f"teeth-{bug}"

        def __init__(self) -> None:
            super().__init__()
            self._attention = _Attention()
            self._caps = dataclasses.replace(self._caps, kv_layouts=(layout,))
            if bug == "halfcausal":  # no float32: the engine checks take the teacher-forced path
                self._caps = dataclasses.replace(self._caps, dtypes=(torch.float16,))

        def decode_ops(self) -> TorchDecodeOps | None:  # the correct one offers the reference ops
            return TorchDecodeOps() if bug == "ok" else NoRopeDecodeOps() if bug == "norope" else None

    _Backend.__name__ = f"TeethBackend_{bug}"
    return _Backend


for _bug in BUGS:
    globals()[f"TeethBackend_{_bug}"] = _backend_class(_bug)


@hookimpl
def hwkv_backends() -> list[BackendSpec]:
    return [
        BackendSpec(f"teeth-{b}", API_VERSION, f"hwkv_teeth_broken:TeethBackend_{b}", f"broken on purpose: {b}")
        for b in BUGS
    ]

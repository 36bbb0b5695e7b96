"""fp8 KV mutants: the reference's quantised write or dequantised read with one realistic mistake
(what a vendor porting vLLM's ``fp8`` cache gets wrong)."""

from __future__ import annotations

from typing import Any

import torch

from conformance.mutants.base import mutant
from hwkv.interfaces.kv_quant import FP8_E4M3_MAX, v_token_view
from hwkv.reference import ReferenceAttentionImpl
from hwkv.reference.attention import paged_attention, split_kv

WRITE = ("test_fp8_kv.py::test_fp8_write_kv[float32-bs16-saturating",)
ATTN = ("test_fp8_kv.py::test_fp8_attention[float32-bs16-decode-gqa4",)


def _writer(name: str, quant: Any) -> type[ReferenceAttentionImpl]:
    """A write_kv storing ``quant(x, scale)`` ([T, H_kv, D], [H_kv]) for each of K and V."""

    def write_kv(self: Any, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slots: torch.Tensor) -> None:
        k_cache, v_cache = split_kv(layer_kv)
        sc = self.scales_for(layer_kv)
        bs = k_cache.shape[1]
        keep = slots >= 0
        s = slots[keep]
        for cache, x, scale in ((k_cache, key, sc[0]), (v_token_view(v_cache), value, sc[1])):
            cache[s // bs, s % bs] = quant(x[: slots.numel()][keep].float(), scale).to(cache.dtype)

    return type(f"FP8Write_{name}", (ReferenceAttentionImpl,), {"write_kv": write_kv})


def _reader(name: str, pick: Any) -> type[ReferenceAttentionImpl]:
    """A forward dequantising with ``pick(scales)`` instead of the layer's own [2, H_kv] scales."""

    def forward(self: Any, query: torch.Tensor, key: Any, value: Any, layer_kv: Any, md: Any) -> torch.Tensor:
        return paged_attention(query, layer_kv, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables,
                               self.scale, kv_scales=pick(self.scales_for(layer_kv)))

    return type(f"FP8Read_{name}", (ReferenceAttentionImpl,), {"forward": forward})


def _truncate(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round toward zero onto the e4m3 grid (a mantissa-masking conversion) instead of to nearest-even."""
    y = (x / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = y.to(torch.float8_e4m3fn)
    codes = q.view(torch.uint8).to(torch.int16)
    over = q.float().abs() > y.abs()  # rounded away from zero: one code back (sign-magnitude: code - 1)
    return torch.where(over, codes - 1, codes).to(torch.uint8).view(torch.float8_e4m3fn).float()


mutant("fp8-write-ignores-scale", "kv_write", "fp8 write casts x without dividing by the head's scale", WRITE,
       impl=_writer("noscale", lambda x, s: x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)))
mutant("fp8-write-multiplies-scale", "kv_write", "fp8 write multiplies by the scale instead of dividing", WRITE,
       impl=_writer("mul", lambda x, s: (x * s[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)))
mutant("fp8-write-no-saturation", "kv_write", "fp8 write converts without saturation (cvt.rn without .satfinite: "
       "values past the e4m3 range become NaN)", WRITE,
       impl=_writer("nosat", lambda x, s: (lambda y: torch.where(y.abs() >= 464, float("nan"), y))(x / s[:, None])))
mutant("fp8-write-truncates", "kv_write", "fp8 write rounds toward zero instead of to nearest-even", WRITE,
       impl=_writer("trunc", _truncate))
mutant("fp8-write-head0-scale", "kv_write", "fp8 write uses KV head 0's scale for every head (per-tensor)", WRITE,
       impl=_writer("head0", lambda x, s: (x / s[0]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)))
mutant("fp8-read-k-scale-for-v", "attention", "fp8 read dequantises V with K's scale", ATTN,
       impl=_reader("kforv", lambda s: torch.stack([s[0], s[0]])))
mutant("fp8-read-ignores-scale", "attention", "fp8 read casts the stored codes without multiplying by the scale",
       ATTN, impl=_reader("noscale", lambda s: torch.ones_like(s)))

"""The suite's tolerance table: one entry per (dtype, op), versioned with the suite.

A result passes when every element satisfies ``|actual - expected| <= atol + rtol * |expected|``
(``torch.allclose``). The expected value is the CPU reference computed in float32 on the *same*
(already rounded) inputs, so a tolerance bounds the backend's own rounding, not the input's.
Changing any number here is a suite change: bump ``SUITE_VERSION``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUITE_VERSION = "3.3.0"

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float

    def __str__(self) -> str:
        return "exact" if self.atol == 0 and self.rtol == 0 else f"atol={self.atol:g} rtol={self.rtol:g}"


EXACT = Tolerance(0.0, 0.0)

# Byte-moving ops (KV write, block copies, transfers, stores) must be bit exact in every dtype.
# Attention tolerances allow for a different summation order (tiling, split-KV merges) and, for
# half types, one rounding of the output plus accumulated rounding of P (softmax) before P @ V.
TABLE: dict[tuple[str, str], Tolerance] = {
    ("float32", "attention"): Tolerance(2e-5, 1e-4),
    ("float16", "attention"): Tolerance(2e-3, 5e-3),
    ("bfloat16", "attention"): Tolerance(1.6e-2, 2e-2),
    # decode ops are checked against the torch reference ops run in the same dtype (their contract is
    # to round where those round), so the bounds cover summation order and a rounding flip that
    # propagates through RoPE or the residual add
    ("float32", "decode_ops"): Tolerance(2e-5, 1e-4),
    ("float16", "decode_ops"): Tolerance(4e-3, 1e-2),
    ("bfloat16", "decode_ops"): Tolerance(3.2e-2, 4e-2),
    # elementwise ops (3.1.0): the model's functions run in the same dtype; the bounds cover rsqrt / exp in
    # their last bit and a rounding flip of an intermediate (RoPE's products, SiLU's sigmoid)
    ("float32", "elementwise"): Tolerance(2e-5, 1e-4),
    ("float16", "elementwise"): Tolerance(4e-3, 1e-2),
    ("bfloat16", "elementwise"): Tolerance(3.2e-2, 4e-2),
    **{(d, op): EXACT for d in DTYPES
       for op in ("kv_write", "copy_blocks", "transfer", "store", "elementwise_exact")},
}


# Half types also get an aggregate bound: the backend's error norm may be at most this many times
# the error of merely rounding the float32 reference to the dtype. Elementwise bounds loose enough
# for bf16 rounding let a systematic bug through (a softmax scale off by 1% passes them); this
# catches it (measured: 1% scale error = 5.5x rounding; a correct bf16 computation = 1.0x).
HALF_NORM_FACTOR: dict[str, float] = {"float16": 4.0, "bfloat16": 4.0}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_override(text: str) -> tuple[tuple[str, str], Tolerance]:
    """``"bfloat16:attention=0.03,0.03"`` → ``(("bfloat16", "attention"), Tolerance(0.03, 0.03))``."""
    try:
        key, vals = text.split("=", 1)
        dtype, op = key.split(":", 1)
        atol, rtol = (float(v) for v in vals.split(","))
    except ValueError:
        raise ValueError(f"--tolerance-override {text!r}: expected DTYPE:OP=ATOL,RTOL") from None
    if (dtype, op) not in TABLE:
        raise ValueError(f"--tolerance-override {text!r}: unknown (dtype, op); allowed: {sorted(TABLE)}")
    if atol < 0 or rtol < 0:
        raise ValueError(f"--tolerance-override {text!r}: tolerances must be >= 0")
    return (dtype, op), Tolerance(atol, rtol)


class ToleranceTable:
    """The table plus this run's overrides (refused by ``--certify``)."""

    def __init__(self, overrides: list[str] | tuple[str, ...] = ()):
        self.overrides = dict(parse_override(o) for o in overrides)

    def get(self, dtype: torch.dtype | str, op: str) -> Tolerance:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        key = (name, op)
        if key in self.overrides:
            return self.overrides[key]
        if key not in TABLE:
            raise KeyError(f"no tolerance for dtype {name!r}, op {op!r}")
        return TABLE[key]

    def as_dict(self) -> dict[str, str]:
        return {f"{d}:{op}": str(t) for (d, op), t in sorted(TABLE.items())}

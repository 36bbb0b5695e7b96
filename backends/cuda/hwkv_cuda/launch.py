"""What a launch may use on a device (SMs, opt-in shared memory, programmatic dependent launch),
probed once per device, and the ``name=value`` tuning overrides the kernels' tile choices read from
the environment (``HWKV_CUDA_ATTN_CONFIG``, ``HWKV_CUDA_DENSE_CONFIG``).

``HWKV_CUDA_PDL=0`` launches without PDL (for A/B runs).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

PDL_ENV = "HWKV_CUDA_PDL"


@functools.cache
def device_limits(device: torch.device) -> tuple[int, int]:
    """``(SMs, opt-in shared memory per block in bytes)``; off CUDA (the interpreter) ``(4, 0)``,
    0 meaning unknown (nothing is shrunk to it)."""
    if device.type != "cuda":
        return 4, 0
    p = torch.cuda.get_device_properties(device)
    return p.multi_processor_count, int(getattr(p, "shared_memory_per_block_optin", 0))


def pdl_available(device: torch.device) -> tuple[bool, str]:
    """Programmatic dependent launch: sm_90+, a Triton with grid dependency control, not interpreted,
    not switched off by ``HWKV_CUDA_PDL=0``; the reason when not."""
    from hwkv_cuda.kernels.dense import gdc_wait

    if os.environ.get(PDL_ENV, "1") == "0":
        return False, f"{PDL_ENV}=0"
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or device.type != "cuda":
        return False, "not on a CUDA device"
    if gdc_wait is None:
        return False, "this Triton has no grid dependency control (triton.language.extra.cuda.gdc_wait)"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False, "needs sm_90 or newer"
    return True, ""


def use_pdl(device: torch.device) -> bool:
    """:func:`pdl_available`, probed once per device and setting of the environment it reads."""
    return _use_pdl(device, os.environ.get(PDL_ENV, "1"), os.environ.get("TRITON_INTERPRET", "0"))


@functools.cache
def _use_pdl(device: torch.device, _pdl_env: str, _interpret: str) -> bool:
    return pdl_available(device)[0]


def parse_overrides(env: str, allowed: Iterable[str]) -> dict[str, int]:
    """The environment variable ``env`` (``"block_n=128,num_warps=8"``; read per call) as a dict.
    Raises ``ValueError`` naming the variable, the bad item and the allowed names."""
    allowed = tuple(allowed)
    out = {}
    for item in filter(None, (s.strip() for s in os.environ.get(env, "").split(","))):
        name, eq, value = item.partition("=")
        name = name.strip().lower()
        try:
            if not eq or name not in allowed:
                raise ValueError
            out[name] = int(value)
        except ValueError:
            raise ValueError(f"{env}: {item!r} is not name=integer with a name among {', '.join(allowed)}") from None
    return out

"""The CPU reference backend (pure torch): the numerical oracle every backend is compared with."""

from hwkv.reference.attention import ReferenceAttentionBackend, ReferenceAttentionImpl, paged_attention
from hwkv.reference.backend import CpuBackend
from hwkv.reference.device import CpuDevice, CpuEvent, CpuStream

__all__ = [
    "CpuBackend", "CpuDevice", "CpuEvent", "CpuStream", "ReferenceAttentionBackend", "ReferenceAttentionImpl",
    "paged_attention",
]

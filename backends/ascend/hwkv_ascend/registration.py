"""HCCS registration of a KV cache: few regions, never more than Mooncake-on-HCCL allows.

HCCL (under Mooncake's ``ascend`` transport) holds at most 256 registered regions per process, and
a model's KV cache is two tensors per layer. As vllm-ascend's kv_transfer utils do, tensors are
grouped by the storage they are views of and each group's ranges are merged when the gap between
them is small; transfer metadata still uses each tensor's own ``data_ptr()``. The Ascend device
allocates a transfer-capable KV cache as one 2 MiB-aligned arena (``AscendDevice.allocate_kv_cache``),
so the whole cache becomes a single region.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hwkv.interfaces import KVCache, TransferError
from hwkv.transfer.mooncake import MooncakeTransfer

MAX_REGIONS = 256  # HCCL's per-process registration limit (vllm-ascend MAX_HCCL_REGISTER_REGIONS)
MERGE_GAP = 4096  # vllm-ascend REGISTER_MERGE_GAP_BYTES: ranges of one storage this close are merged


def _storage_key(t: torch.Tensor) -> int:
    # groups views only: an aligned view's storage pointer is the raw allocation, not the region start
    try:
        return t.untyped_storage().data_ptr()
    except Exception:
        return t.data_ptr()


def merged_regions(tensors: Iterable[torch.Tensor], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """``(ptr, nbytes)`` regions covering every tensor: per storage, ranges sorted and merged where
    they overlap or lie at most ``gap`` bytes apart (the gap lies inside that one allocation)."""
    by_storage: dict[int, list[tuple[int, int]]] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        if not t.is_contiguous():
            raise ValueError(f"KV tensor {tuple(t.shape)} at {t.data_ptr():#x} is not contiguous: its bytes are "
                             "not one range (allowed: contiguous tensors)")
        start = t.data_ptr()
        by_storage.setdefault(_storage_key(t), []).append((start, start + t.numel() * t.element_size()))
    regions: list[tuple[int, int]] = []
    for ranges in by_storage.values():
        ranges.sort()
        lo, hi = ranges[0]
        for s, e in ranges[1:]:
            if s <= hi + gap:
                hi = max(hi, e)
            else:
                regions.append((lo, hi - lo))
                lo, hi = s, e
        regions.append((lo, hi - lo))
    return sorted(regions)


def kv_regions(kv_cache: KVCache, gap: int = MERGE_GAP, already: int = 0) -> list[tuple[int, int]]:
    """The regions to register for ``kv_cache``; ``ValueError`` when they (plus ``already``
    registered ones) exceed :data:`MAX_REGIONS`."""
    regions = merged_regions(kv_cache.tensors, gap)
    if len(regions) + already > MAX_REGIONS:
        n = len(kv_cache.tensors)
        raise ValueError(
            f"KV cache needs {len(regions)} registered regions ({n} tensors, "
            f"{sum(b for _, b in regions)} bytes) and {already} are registered already: more than the "
            f"{MAX_REGIONS} HCCL allows per process; allocate the cache as one arena "
            "(AscendBackend(transfer=True) or create_transfer() before allocating it)")
    return regions


def register_kv_cache(endpoint: Any, kv_cache: KVCache, gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """Register ``kv_cache`` with a Transfer (``register``) or a Store (``register_buffer``) as
    merged regions; returns them. All or nothing: if one registration fails, the ones made are
    released and the error propagates."""
    register = getattr(endpoint, "register", None) or endpoint.register_buffer
    unregister = getattr(endpoint, "unregister", None) or endpoint.unregister_buffer
    listed = getattr(endpoint, "registered_buffers", None)
    regions = kv_regions(kv_cache, gap, already=len(listed()) if listed else 0)
    done: list[int] = []
    try:
        for ptr, nbytes in regions:
            register(ptr, nbytes)
            done.append(ptr)
    except BaseException:
        for ptr in reversed(done):
            unregister(ptr)
        raise
    return regions


def unregister_kv_cache(endpoint: Any, regions: list[tuple[int, int]]) -> None:
    """Release what :func:`register_kv_cache` registered."""
    unregister = getattr(endpoint, "unregister", None) or endpoint.unregister_buffer
    for ptr, _ in regions:
        unregister(ptr)


class HccsTransfer(MooncakeTransfer):
    """Core's Mooncake endpoint on the ``ascend`` (HCCS) transport, refusing a registration past
    HCCL's per-process limit with a reason instead of the transport's bare error code."""

    def register(self, ptr: int, nbytes: int) -> None:
        if len(self.registered_buffers()) >= MAX_REGIONS:
            raise TransferError(f"register({ptr:#x}, {nbytes}): {MAX_REGIONS} regions are registered already, the "
                                "most HCCL allows per process; register a KV cache with "
                                "AscendBackend.register_kv_cache (one region per arena)")
        super().register(ptr, nbytes)

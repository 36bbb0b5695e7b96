"""Device mutants: ``memory_info`` and ``copy_blocks`` of the reference device with one mistake."""

from __future__ import annotations

from typing import Any

import torch

from conformance.mutants.base import mutant
from hwkv.interfaces import Device, KVCache, group_concurrent_contiguous
from hwkv.reference import CpuDevice

MEM = ("test_memory_info", "test_pool_sized_from_memory")
COPY = ("test_copy_blocks[default_stream-float32-device_to_device", "test_copy_blocks")


class _Device(CpuDevice):
    def __init__(self) -> None:
        super().__init__()
        self._boot = super().memory_info()


def _device(name: str, **methods: Any) -> type[CpuDevice]:
    return type(f"Device_{name}", (_Device,), methods)


def _copy(pairs_fn: Any = None, tensors: slice = slice(None), via: torch.dtype | None = None) -> Any:
    """copy_blocks that validates, then copies ``pairs_fn(pairs)`` of ``tensors`` (optionally staged
    through ``via``)."""

    def copy_blocks(self: Device, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]], stream: Any = None) -> None:
        if self.check_copy(src, dst, pairs) is None:
            return
        pairs = pairs_fn(pairs) if pairs_fn is not None else pairs
        if not pairs:
            return
        s_idx = torch.tensor([p[0] for p in pairs])
        d_idx = torch.tensor([p[1] for p in pairs])
        for ts, td in list(zip(src.tensors, dst.tensors))[tensors]:
            blocks = ts.index_select(0, s_idx)
            if via is not None and blocks.dtype != via:
                blocks = blocks.to(via).to(ts.dtype)
            td.index_copy_(0, d_idx, blocks)

    return copy_blocks


def _chunks_drop_partial(pairs: list[tuple[int, int]], chunk: int = 32) -> list[tuple[int, int]]:
    return pairs[: len(pairs) - len(pairs) % chunk] if len(pairs) >= chunk else pairs


def _sorted_unpaired(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return list(zip(sorted(p[0] for p in pairs), sorted(p[1] for p in pairs)))


def _unchecked(self: Device, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]], stream: Any = None) -> None:
    """BUG: no validation (the contract's ValueError / IndexError never come)."""
    if not pairs:
        return
    s_idx, d_idx = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
    for ts, td in zip(src.tensors, dst.tensors):
        n = ts.shape[0]
        keep = (s_idx < n) & (d_idx < n)
        td.index_copy_(0, d_idx[keep], ts.index_select(0, s_idx[keep]))


def _runs_short(self: Device, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]], stream: Any = None) -> None:
    """BUG: consecutive pairs merged into runs, each run copied one block short."""
    if self.check_copy(src, dst, pairs) is None:
        return
    runs = group_concurrent_contiguous([s for s, _ in pairs], [d for _, d in pairs])
    for ts, td in zip(src.tensors, dst.tensors):
        for s, d, n in runs:
            m = n - 1 if n > 1 else n
            td[d : d + m].copy_(ts[s : s + m])


def _pool_sized_table(self: Device, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]],
                      stream: Any = None) -> None:
    """BUG: the pair table is sized from the smaller cache (the device pool): pairs that reach into a
    larger host tier are dropped."""
    n = min(src.spec.num_blocks, dst.spec.num_blocks)
    _copy(lambda p: [(s, d) for s, d in p if s < n and d < n])(self, src, dst, pairs, stream)


mutant("mem-static", "device", "memory_info measured once at start-up and cached", MEM,
       device=_device("static", memory_info=lambda self: self._boot))
mutant("mem-kib", "device", "memory_info in KiB instead of bytes", MEM,
       device=_device("kib", memory_info=lambda self: tuple(x // 1024 for x in CpuDevice.memory_info(self))))
mutant("mem-total-as-free", "device", "memory_info returns (total, total)", MEM,
       device=_device("total", memory_info=lambda self: (CpuDevice.memory_info(self)[1],) * 2))
mutant("mem-used-as-free", "device", "memory_info returns used memory as free", MEM,
       device=_device("used", memory_info=lambda self: (lambda f, t: (t - f, t))(*CpuDevice.memory_info(self))))
mutant("copy-chunk-tail-dropped", "device", "copy_blocks in chunks of 32 pairs; the partial last chunk is dropped",
       COPY, device=_device("chunk", copy_blocks=_copy(_chunks_drop_partial)))
mutant("copy-pair-limit-64", "device", "copy_blocks takes at most 64 pairs (a fixed index buffer)", COPY,
       device=_device("limit", copy_blocks=_copy(lambda p: p[:64])))
mutant("copy-sorted-unpaired", "device", "sources and destinations sorted separately for coalescing", COPY,
       device=_device("sorted", copy_blocks=_copy(_sorted_unpaired)))
mutant("copy-skips-last-tensor", "device", "the last KV tensor (last layer) is not copied (off-by-one)", COPY,
       device=_device("tensors", copy_blocks=_copy(tensors=slice(None, -1))))
mutant("copy-fp16-staging", "device", "blocks staged through a float16 buffer", COPY,
       device=_device("fp16", copy_blocks=_copy(via=torch.float16)))
mutant("copy-unchecked", "device", "copy_blocks skips validation (bad ids, repeated destinations pass silently)",
       COPY, device=_device("unchecked", copy_blocks=_unchecked))
mutant("copy-runs-short", "device", "merged runs of consecutive blocks copied one block short", COPY,
       device=_device("runs", copy_blocks=_runs_short))
mutant("copy-table-sized-from-pool", "device", "pairs reaching past the smaller cache's block count dropped (a "
       "host tier larger than the device pool)", COPY, device=_device("pool", copy_blocks=_pool_sized_table))

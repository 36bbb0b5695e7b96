"""Block copies between two KV caches (device and host tier) on a given stream.

Runs consecutive on both sides are merged (as vLLM's offload and P/D connectors do); a run of at
least ``min_run_blocks`` becomes one runtime memcpy per KV tensor (the copy engines reach full
host-link bandwidth on large transfers), the scattered rest goes through ``Device.copy_blocks`` (one
batched launch per tensor), so neither thousands of tiny memcpys nor a gather of big runs happens.

The default threshold depends on where the copy runs. Between host tensors a memcpy beats the
gather from 4 blocks on (23 vs 4-5 GB/s on 1 MiB runs, reference backend). Across a host link the
gather wins until runs are large: H100, 32 KiB per block and tensor, memcpy per run 2-8 GB/s at 1-4
blocks and 39-45 GB/s at 0.5 MiB, ``copy_blocks`` 32-48 GB/s throughout, memcpy ahead from 2 MiB
(``hwkv bench offload``, two runs of 2026-11-24).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from hwkv.interfaces.layout import KVCache, group_concurrent_contiguous

HOST_MIN_RUN_BLOCKS = 4
DEVICE_MIN_RUN_BYTES = 2 << 20  # per tensor


def auto_min_run_blocks(src: KVCache, dst: KVCache) -> int:
    """The run length from which a memcpy per run beats ``Device.copy_blocks`` (module docstring)."""
    if src.tensors[0].device.type == "cpu" and dst.tensors[0].device.type == "cpu":
        return HOST_MIN_RUN_BLOCKS
    return max(HOST_MIN_RUN_BLOCKS, -(-DEVICE_MIN_RUN_BYTES // src.block_nbytes(0)))


class CopyPlan(NamedTuple):
    """How one block list is copied: ``long`` runs ``(src, dst, n)`` by memcpy, ``short`` pairs
    through ``Device.copy_blocks``. The same for every layer, so a layer-by-layer copy plans once."""

    long: list[tuple[int, int, int]]
    short: list[tuple[int, int]]


def plan_copy(src: KVCache, dst: KVCache, src_ids: list[int], dst_ids: list[int],
              min_run_blocks: int | None = None) -> CopyPlan:
    if min_run_blocks is None:
        min_run_blocks = auto_min_run_blocks(src, dst)
    runs = group_concurrent_contiguous(list(src_ids), list(dst_ids))
    return CopyPlan([r for r in runs if r[2] >= min_run_blocks],
                    [(s + k, d + k) for s, d, n in runs if n < min_run_blocks for k in range(n)])


def run_copy(dev: Any, src: KVCache, dst: KVCache, plan: CopyPlan, stream: Any) -> None:
    """Queue ``plan``'s copies from ``src`` to ``dst`` (every tensor) on ``stream``."""
    if plan.long:
        with dev.stream_context(stream):
            for ts, td in zip(src.tensors, dst.tensors):
                for s, d, n in plan.long:
                    td[d:d + n].copy_(ts[s:s + n], non_blocking=True)
    if plan.short:
        dev.copy_blocks(src, dst, plan.short, stream)


def copy_block_pairs(dev: Any, src: KVCache, dst: KVCache, src_ids: list[int], dst_ids: list[int],
                     stream: Any, min_run_blocks: int | None = None) -> None:
    """Queue copies of block ``src_ids[i]`` of ``src`` to ``dst_ids[i]`` of ``dst`` (every tensor) on
    ``stream``. Completion is observed through an event the caller records after this. Runs of at
    least ``min_run_blocks`` (default :func:`auto_min_run_blocks`) are memcpys."""
    run_copy(dev, src, dst, plan_copy(src, dst, src_ids, dst_ids, min_run_blocks), stream)

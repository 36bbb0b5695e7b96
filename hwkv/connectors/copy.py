"""Block copies between two KV caches (device and host tier) on a given stream.

Runs consecutive on both sides are merged (as vLLM's offload and P/D connectors do); a run of at
least ``min_run_blocks`` becomes one runtime memcpy per KV tensor (the copy engines reach full
host-link bandwidth on large transfers), the scattered rest goes through ``Device.copy_blocks`` (one
batched launch per tensor), so neither thousands of tiny memcpys nor a gather of big runs happens.
"""

from __future__ import annotations

from typing import Any

from hwkv.interfaces.layout import KVCache, group_concurrent_contiguous


def copy_block_pairs(dev: Any, src: KVCache, dst: KVCache, src_ids: list[int], dst_ids: list[int],
                     stream: Any, min_run_blocks: int = 4) -> None:
    """Queue copies of block ``src_ids[i]`` of ``src`` to ``dst_ids[i]`` of ``dst`` (every tensor) on
    ``stream``. Completion is observed through an event the caller records after this."""
    runs = group_concurrent_contiguous(list(src_ids), list(dst_ids))
    long = [r for r in runs if r[2] >= min_run_blocks]
    short = [(s + k, d + k) for s, d, n in runs if n < min_run_blocks for k in range(n)]
    if long:
        with dev.stream_context(stream):
            for ts, td in zip(src.tensors, dst.tensors):
                for s, d, n in long:
                    td[d:d + n].copy_(ts[s:s + n], non_blocking=True)
    if short:
        dev.copy_blocks(src, dst, short, stream)

"""Heterogeneous tensor parallelism for KV transfer: which KV heads of which producer rank each
consumer rank needs, when a prefill instance with ``tp=P`` hands KV to a decode instance with
``tp=D`` (``P % D == 0`` or ``D % P == 0``), as vLLM's NIXL connector and vLLM-Ascend's Mooncake
connector map them.

Every rank's KV cache holds, per block, only its own KV heads (:func:`kv_heads_of`, the rule the
model's sharding uses: heads split evenly when ``num_kv_heads >= tp``, else one head replicated on
``tp / num_kv_heads`` ranks). Block ids are the same on every rank of an instance, so a transfer
maps block ids as usual and, inside each block, copies head slices: :func:`map_kv_heads` lists them
per ``(src rank, dst rank)``, with head indices local to each side's block. The p2p connector turns
a slice into byte ranges with its layout's head stride. Where the producer replicates a head, the
consumers' reads are spread over its holders. :func:`copy_head_slices` is the reference
transfer between caches in one process.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class HeadSlice(NamedTuple):
    """Heads ``[src_head, src_head + num_heads)`` of ``src_rank``'s blocks fill heads
    ``[dst_head, dst_head + num_heads)`` of ``dst_rank``'s blocks (indices local to each rank)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def kv_heads_of(num_kv_heads: int, tp: int, rank: int) -> range:
    """The global KV heads ``rank`` of a ``tp``-rank instance holds."""
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"num_kv_heads {num_kv_heads} and tp {tp}: one must divide the other")
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside [0, {tp})")
    per = max(1, num_kv_heads // tp)
    start = rank * num_kv_heads // tp
    return range(start, start + per)


def map_kv_heads(num_kv_heads: int, producer_tp: int, consumer_tp: int) -> list[HeadSlice]:
    """Every head slice the consumer ranks read, sorted by ``(dst_rank, dst_head)``; each consumer
    head is covered exactly once."""
    p_tp, d_tp = producer_tp, consumer_tp
    if p_tp < 1 or d_tp < 1 or (p_tp % d_tp and d_tp % p_tp):
        raise ValueError(f"producer tp {p_tp} and consumer tp {d_tp}: one must divide the other "
                         "(allowed: P % D == 0 or D % P == 0)")
    src_of = [kv_heads_of(num_kv_heads, p_tp, p) for p in range(p_tp)]
    out: list[HeadSlice] = []
    for d in range(d_tp):
        mine = kv_heads_of(num_kv_heads, d_tp, d)
        for i, h in enumerate(mine):
            holders = [p for p in range(p_tp) if h in src_of[p]]
            p = holders[d % len(holders)]  # spread replicated heads over their holders
            src_head = h - src_of[p].start
            last = out[-1] if out else None
            if (last is not None and last.dst_rank == d and last.src_rank == p
                    and last.src_head + last.num_heads == src_head and last.dst_head + last.num_heads == i):
                out[-1] = last._replace(num_heads=last.num_heads + 1)
            else:
                out.append(HeadSlice(p, d, src_head, i, 1))
    return out


def copy_head_slices(slices: list[HeadSlice], src: list[Any], dst: list[Any],
                     block_pairs: list[tuple[int, int]]) -> None:
    """The reference transfer, for caches in one process (tests, and the model a p2p connector
    implements with byte ranges): for every slice, its heads of blocks ``s`` of ``src[src_rank]``
    go to blocks ``d`` of ``dst[dst_rank]``, for each ``(s, d)`` in ``block_pairs``. Every KV
    layout keeps heads in dim -2 of each tensor (``KVCacheSpec.tensor_shapes``); both sides must
    share the layout, block size and head size."""
    if not block_pairs:
        return
    s_idx = torch.tensor([s for s, _ in block_pairs], dtype=torch.long)
    d_idx = torch.tensor([d for _, d in block_pairs], dtype=torch.long)
    for sl in slices:
        a, b = src[sl.src_rank], dst[sl.dst_rank]
        if a.layout != b.layout or len(a.tensors) != len(b.tensors):
            raise ValueError("copy_head_slices needs caches of the same layout")
        for ts, td in zip(a.tensors, b.tensors):
            heads = ts[s_idx.to(ts.device)][..., sl.src_head:sl.src_head + sl.num_heads, :]
            td[d_idx.to(td.device), ..., sl.dst_head:sl.dst_head + sl.num_heads, :] = heads.to(td.device)

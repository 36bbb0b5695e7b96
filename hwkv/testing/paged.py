"""Test data for paged attention shared by the suites of every backend."""

from __future__ import annotations

import math

import torch


def random_block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator,
                        spare: int = 3) -> tuple[list[list[int]], int]:
    """Disjoint, non-contiguous, out-of-order block ids per request; returns (tables, num_blocks)."""
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        row = perm[i : i + n]
        if n >= 2 and row == sorted(row):
            row = row[::-1]  # guarantee at least one descending pair
        tables.append(row)
        i += n
    return tables, num_blocks

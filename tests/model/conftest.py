"""Helpers for model tests: the CPU reference backend and a varlen forward over a paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hwkv.interfaces.attention import AttentionMetadata


@pytest.fixture(scope="session")
def cpu_backend():
    from hwkv.plugins import get_backend

    return get_backend("cpu")


class PagedRunner:
    """Runs a model over requests with disjoint block tables in one KV cache, in steps where each
    request computes ``tokens[start:end]`` on top of its cached ``tokens[:start]``."""

    def __init__(self, model, backend, num_reqs: int, max_len: int, block_size: int = 4):
        self.model, self.backend, self.bs = model, backend, block_size
        per_req = -(-max_len // block_size)
        spec = model.kv_cache_spec(num_blocks=num_reqs * per_req, block_size=block_size)
        self.kv = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout)
        # Interleave requests' blocks so a wrong block-table lookup cannot go unnoticed.
        self.tables = [[b * num_reqs + r for b in range(per_req)] for r in range(num_reqs)]

    def step(self, work: Sequence[tuple[int, Sequence[int], int, int]]) -> torch.Tensor:
        """``work``: ``(req, tokens, start, end)`` per scheduled request → logits at each ``end - 1``."""
        qlens = [end - start for _, _, start, end in work]
        meta = AttentionMetadata.build(qlens, [end for *_, end in work], [self.tables[r] for r, *_ in work], self.bs)
        ids = torch.tensor([t for _, toks, s, e in work for t in toks[s:e]], dtype=torch.long)
        pos = torch.cat([torch.arange(s, e) for _, _, s, e in work])
        idx = torch.cumsum(torch.tensor(qlens), 0) - 1
        with torch.inference_mode():
            return self.model(ids, pos, self.kv, self.backend.attention.metadata_builder().build(meta), idx)


@pytest.fixture
def paged_runner():
    return PagedRunner

"""The half-precision bound of the conformance suite separates rounding from systematic error."""

from __future__ import annotations

import math

import pytest
import torch

from conformance.check import Check
from conformance.report import Record
from conformance.tolerances import ToleranceTable
from hwkv.reference.attention import paged_attention
from hwkv.testing.paged import random_block_tables


def _case(dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    bs, hkv, d, sl, ql = 16, 2, 64, [90, 40, 33], [1, 40, 9]
    tables, nb = random_block_tables(sl, bs, g)
    bt = torch.zeros(len(sl), max(map(len, tables)), dtype=torch.int32)
    for r, row in enumerate(tables):
        bt[r, : len(row)] = torch.tensor(row)
    kv = torch.randn(nb, 2, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(sum(ql), 8, d, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.cumsum(torch.tensor(ql), 0).tolist()], dtype=torch.int32)
    return q, kv, qsl, torch.tensor(sl, dtype=torch.int32), bt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", [0, 1])
def test_rounding_passes_and_a_one_percent_scale_error_fails(dtype, seed):
    q, kv, qsl, sl, bt = _case(dtype, seed)
    scale = 1 / math.sqrt(q.shape[-1])
    expected = paged_attention(q.float(), kv.float(), qsl, sl, bt, scale)
    check = Check(Record(), ToleranceTable())
    check.close(paged_attention(q, kv, qsl, sl, bt, scale), expected, dtype, "attention", "correct")
    with pytest.raises(AssertionError):
        check.close(paged_attention(q, kv, qsl, sl, bt, scale * 1.01), expected, dtype, "attention", "scale bug")

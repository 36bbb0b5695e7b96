"""Attention: all four states × GQA ratios × block sizes × dtypes × head sizes, against the reference.

Every case uses ragged lengths, disjoint block tables that are non-contiguous and out of order, a
cache pre-filled with garbage (reads of unwritten slots show) and decoy K/V in another layer.
"""

from __future__ import annotations

import pytest
import torch

from conformance.harness import GQA, STATES, make_case, run_attention
from conformance.report import not_supported

pytestmark = pytest.mark.capability("attention")


@pytest.mark.parametrize("gqa", list(GQA), ids=[g if g == "mqa" else f"gqa{g}" for g in GQA])
@pytest.mark.parametrize("state", STATES)
def test_attention(backend, reference, check, gen, dtype, block_size, head_size, gqa, state):
    num_heads, num_kv_heads = GQA[gqa]
    case = make_case(state, block_size, num_heads, num_kv_heads, head_size, dtype, gen)
    check.capability = f"attention/{state}"
    reasons = backend.capabilities.validate(case.spec(dtype), num_heads=num_heads)
    if reasons:
        not_supported(reasons)
    out = run_attention(backend, case, dtype)
    # The oracle: the reference in float32 on the same (already rounded) inputs.
    expected = run_attention(reference, case, torch.float32)
    check.close(out, expected, dtype, "attention", f"attention {state} output [tokens, heads, head_size]")

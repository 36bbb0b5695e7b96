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


def production_head_size(caps) -> int:
    """128 (the common production head size) where declared, else the largest declared one."""
    return 128 if caps.head_sizes is None or 128 in caps.head_sizes else max(caps.head_sizes)


@pytest.mark.timeout_s(300)
def test_attention_production(backend, reference, check, gen, dtype, block_size):
    """Production sizes at every block size: :func:`~conformance.harness.production_scenario` (>= 33
    blocks, > 4096 tokens, 12 requests of very unequal lengths), logits of order 10, a non-default
    scale, q/k/v as strided views of a fused projection, then a second (reordered) decode step."""
    num_heads, num_kv_heads = GQA["4"]
    head_size = production_head_size(backend.capabilities)
    case = make_case("production", block_size, num_heads, num_kv_heads, head_size, dtype, gen)
    check.capability = "attention/production"
    reasons = backend.capabilities.validate(case.spec(dtype), num_heads=num_heads)
    if reasons:
        not_supported(reasons)
    out = run_attention(backend, case, dtype)
    expected = run_attention(reference, case, torch.float32)
    check.close(out, expected, dtype, "attention", "attention production output (step 1 + step 2) [tokens, heads, "
                "head_size]")

"""Per-layer attention parameters (``Capabilities.attention_features``): sliding window, logit
soft-cap and per-head sinks, alone and together, against the reference. NOT_SUPPORTED, with the
backend's reason, for a feature it does not declare.

The window (13 keys) is far shorter than the production case's contexts (> 4096 tokens), so a decode
that reads the whole context, or one key too many, shows; the soft-cap (8) bites on the production
case's logits (std ~4.5); sinks are ~N(0, 2^2), one per query head."""

from __future__ import annotations

import pytest
import torch

from conformance.harness import GQA, make_case, run_attention
from conformance.report import not_supported
from conformance.test_attention import production_head_size

pytestmark = pytest.mark.capability("attention_features")

FEATURES = {  # name: (capabilities needed, impl parameters; sinks drawn per case)
    "window": (("sliding_window",), {"window": 13}),
    "softcap": (("logit_softcap",), {"softcap": 8.0}),
    "sinks": (("attention_sinks",), {}),
    "all": (("sliding_window", "logit_softcap", "attention_sinks"), {"window": 13, "softcap": 8.0}),
}


def _run(backend, reference, check, gen, dtype, block_size, feature, state):
    needs, params = FEATURES[feature]
    num_heads, num_kv_heads = GQA["4"]
    head_size = production_head_size(backend.capabilities)
    case = make_case(state, block_size, num_heads, num_kv_heads, head_size, dtype, gen)
    check.capability = f"attention_features/{feature}"
    reasons = backend.capabilities.validate(case.spec(dtype), num_heads=num_heads, attention_features=needs)
    if reasons:
        not_supported(reasons)
    if "attention_sinks" in needs:
        params = {**params, "sinks": torch.randn(num_heads, generator=gen) * 2.0}
    out = run_attention(backend, case, dtype, features=params)
    expected = run_attention(reference, case, torch.float32, features=params)
    check.close(out, expected, dtype, "attention",
                f"attention {state} with {feature} output [tokens, heads, head_size]")


@pytest.mark.parametrize("feature", list(FEATURES))
def test_attention_features(backend, reference, check, gen, dtype, block_size, feature):
    """All four states in one batch (prefill, chunk on a prefix, decode), every block size."""
    _run(backend, reference, check, gen, dtype, block_size, feature, "mixed")


@pytest.mark.timeout_s(300)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_attention_features_production(backend, reference, check, gen, dtype, feature):
    """Production sizes (> 4096 tokens, 12 unequal requests, a reordered second decode step) at the
    default block size."""
    _run(backend, reference, check, gen, dtype, backend.capabilities.default_block_size, feature, "production")

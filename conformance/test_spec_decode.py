"""Speculative decoding on the backend under test.

* Attention: verify steps — every decoding request runs k + 1 query tokens (its last token and k
  drafts) on a long cached context (> 4096 tokens, >= 33 blocks), beside plain one-token decodes,
  in the shape a batch of speculating requests takes; against the float32 reference.
* Engine: greedy speculative decoding (n-gram, and a draft model that is the target itself) gives
  the reference engine's non-speculative tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from conformance.harness import GQA, AttentionCase, randn, run_attention
from conformance.report import not_supported
from conformance.test_engine import generate, setup, tiny  # noqa: F401  (fixtures)
from hwkv.testing.paged import random_block_tables

pytestmark = pytest.mark.timeout_s(600)


def verify_scenario(bs: int, k: int) -> list[tuple[int, int]]:
    """``(cached_context_len, query_len)``: k + 1-token verify queries on long and short cached
    contexts (block-aligned and not), shorter verifies (drafts trimmed by max_tokens or the token
    budget: 2 and 8 tokens) and one-token decodes (requests whose proposer found no draft)."""
    n = max(33 * bs + 7, 4500)
    return [(n - k - 1, k + 1), (n // 2 + 3, k + 1), (2 * bs, k + 1), (bs - 1 if bs > 1 else 1, k + 1),
            (n - 1, 1), (5, 2), (3 * bs + 1, k + 1), (17, 1), (n - 9, 8)]


def verify_case(bs: int, k: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                gen: torch.Generator) -> AttentionCase:
    reqs = verify_scenario(bs, k)
    order = torch.randperm(len(reqs), generator=gen).tolist()
    reqs = [reqs[i] for i in order]
    tables, nb = random_block_tables([c + q for c, q in reqs], bs, gen)
    t, c = sum(q for _, q in reqs), sum(c for c, _ in reqs)
    rnd = lambda n, h, m=1.0: (randn(gen, n, h, head_size) * m).to(dtype).float()
    return AttentionCase(
        reqs, tables, nb, bs, num_heads, num_kv_heads, head_size,
        q=rnd(t, num_heads, 4.0), k_new=rnd(t, num_kv_heads, 1.5), v_new=rnd(t, num_kv_heads),
        k_ctx=rnd(c, num_kv_heads, 1.5), v_ctx=rnd(c, num_kv_heads), decoy=rnd(c + t, num_kv_heads),
        fill_seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)), scale=1.0 / math.sqrt(head_size),
    )


@pytest.mark.capability("attention")
def test_attention_verify_queries(backend, reference, check, gen, dtype, block_size):
    k = 4
    num_heads, num_kv_heads = GQA["4"]
    caps = backend.capabilities
    head_size = 128 if caps.head_sizes is None or 128 in caps.head_sizes else max(caps.head_sizes)
    case = verify_case(block_size, k, num_heads, num_kv_heads, head_size, dtype, gen)
    check.capability = "attention/spec_verify"
    reasons = caps.validate(case.spec(dtype), num_heads=num_heads)
    if reasons:
        not_supported(reasons)
    out = run_attention(backend, case, dtype)
    expected = run_attention(reference, case, torch.float32)
    check.close(out, expected, dtype, "attention", f"attention k+1={k + 1} verify queries on long cached contexts")


def _repetitive(st, n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a motif, so the n-gram proposer drafts from the first step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        motif = torch.randint(3, 500, (3 + i,), generator=g).tolist()
        out.append(motif * (2 + (st.block_size + 2) // len(motif)))
    return out


@pytest.mark.capability("engine")
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_greedy_matches_reference(engine_backend, check, setup, method):  # noqa: F811
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = setup.path  # the target as its own draft: every draft verified, most accepted
    else:
        spec.update(prompt_lookup_min=1, prompt_lookup_max=3)
    prompts = _repetitive(setup, 3, seed=7) + setup.prompts([setup.block_size + 3], seed=8)
    got, stats = generate(engine_backend, setup, prompts, 20, speculative_config=spec)
    assert stats["spec_decode"]["draft_tokens"] > 0, f"no drafts were verified: {stats['spec_decode']}"
    setup.agree(check, got, prompts, 20, f"speculative ({method}) greedy tokens vs non-speculative reference")

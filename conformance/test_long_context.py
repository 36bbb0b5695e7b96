"""Attention at the lengths and pool sizes production reaches (suite 3.0).

Bugs that only exist past a size: split-KV partition tables sized for 32k keys, partition counts
that overflow at 128k, block tables copied into fixed 2,048-entry buffers, block ids narrowed to
int16 / uint16 (wrong past 2^15 / 2^16), verify queries (k + 1 tokens) at long contexts, padded
rows of a graph-sized batch. One batch per case holds them all:

* a decode at 128k + 4 keys (past 2^17) and five k+1 verify queries ending at 128k;
* decodes around 32k (one ending exactly at 32,768 keys, one at 32,868);
* a 16-token chunk on a 40k prefix and two short requests;
* padded rows: decodes of length 1 whose slot is -1, as a graph runner pads a batch (their output is
  not checked, the cache must not change for them and the real rows must be right).

The pool holds more than 2^16 blocks and every block table draws ids across the whole pool, so
most ids are above 2^15 and many above 2^16; at the smallest block size every long request's
table has more than 2,048 entries. Inputs are of realistic magnitude (as ``production``). Cases:
every declared dtype at the default block size, and the smallest declared block size once.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from conformance.harness import AttentionCase, new_cache, randn, read_tokens, run_attention
from conformance.report import not_supported
from hwkv.interfaces import AttentionMetadata, KVCacheSpec
from hwkv.testing.paged import random_block_tables

pytestmark = [pytest.mark.capability("attention"), pytest.mark.timeout_s(300)]
K128, K32 = 1 << 17, 1 << 15
POOL = (1 << 16) + 4096  # blocks: ids past 2^16
HEADS, KV_HEADS = 8, 1


def long_scenario() -> list[tuple[int, int]]:
    return [(K128 + 3, 1), (K128 - 5, 5), (K32 - 1, 1), (K32 + 100, 1), (40000 - 16, 16), (5, 1), (0, 9)]


def long_head_size(caps) -> int:
    return 64 if caps.head_sizes is None or 64 in caps.head_sizes else min(caps.head_sizes)


def long_case(bs: int, head_size: int, dtype: torch.dtype, gen: torch.Generator) -> AttentionCase:
    reqs = long_scenario()
    order = torch.randperm(len(reqs), generator=gen).tolist()
    reqs = [reqs[i] for i in order]
    need = sum(-(-(c + q) // bs) for c, q in reqs)
    tables, nb = random_block_tables([c + q for c, q in reqs], bs, gen, spare=max(3, POOL - need))
    t, c = sum(q for _, q in reqs), sum(c for c, _ in reqs)
    rnd = lambda n, h, m=1.0: (randn(gen, n, h, head_size) * m).to(dtype).float()
    return AttentionCase(reqs, tables, nb, bs, HEADS, KV_HEADS, head_size,
                         q=rnd(t, HEADS, 4.0), k_new=rnd(t, KV_HEADS, 1.5), v_new=rnd(t, KV_HEADS),
                         k_ctx=rnd(c, KV_HEADS, 1.5), v_ctx=rnd(c, KV_HEADS), decoy=None, fill_seed=None,
                         scale=0.75 / math.sqrt(head_size))


def compact(case: AttentionCase) -> AttentionCase:
    """The same case on the fewest blocks, ids renumbered in order of use: for the reference only. The
    oracle's block ids cannot change its output, and the whole pool in float32 is ~4.6 GB at block size
    128 (the backend under test still gets the ids past 2^16)."""
    ids: dict[int, int] = {}
    tables = [[ids.setdefault(b, len(ids)) for b in t] for t in case.tables]
    return replace(case, tables=tables, num_blocks=len(ids))


@pytest.mark.slow
def test_attention_long_context(backend, reference, check, gen, long_combo):
    """128k / 32k / 40k-prefix requests with k+1 verify queries, > 2^16 blocks, > 2,048-entry tables."""
    dtype, bs = long_combo
    caps = backend.capabilities
    hs = long_head_size(caps)
    case = long_case(bs, hs, dtype, gen)
    check.capability = "attention/long_context"
    reasons = caps.validate(case.spec(dtype), num_heads=HEADS)
    if reasons:
        not_supported(reasons)
    assert max(max(t) for t in case.tables) >= 1 << 16 and case.num_blocks > 1 << 16
    out = run_attention(backend, case, dtype)
    expected = run_attention(reference, compact(case), torch.float32)
    check.close(out, expected, dtype, "attention", "attention at 128k / 32k contexts, > 2^16 blocks [tokens, heads, "
                "head_size]")


def test_attention_padded_rows(backend, reference, check, gen, dtype):
    """A decode batch padded as a graph runner pads it: rows of query length 1 and seq length 1 whose
    slot is -1 and whose block table row is zeros (block 0 holds a real request's KV). The real rows
    agree with the reference; the cache is unchanged except at the real rows' slots."""
    caps = backend.capabilities
    bs, hs = caps.default_block_size, long_head_size(caps)
    reqs = [(3 * bs + 2, 1), (bs - 1, 1), (7, 1), (2 * bs, 1)]
    tables, nb = random_block_tables([c + q for c, q in reqs], bs, gen)
    spec = KVCacheSpec(1, nb, bs, KV_HEADS, hs, dtype)
    reasons = caps.validate(spec, num_heads=HEADS)
    check.capability = "attention/padded_rows"
    if not caps.graph_capture:
        # only a graph replay pads a batch with rows whose slot is -1; an eager step has none
        reasons = [*reasons,
                   "padded rows not supported (allowed: backends with graph capture, the only ones that pad a batch)"]
    if reasons:
        not_supported(reasons)
    tables[0][0], zero_owner = 0, tables[0][0]  # block 0 belongs to a real request
    tables = [[zero_owner if b == 0 and (r, i) != (0, 0) else b for i, b in enumerate(t)] for r, t in enumerate(tables)]
    pad = 5
    n_real = len(reqs)
    outs, caches = [], []
    for be, dt in ((backend, dtype), (reference, torch.float32)):
        g = torch.Generator().manual_seed(1234)
        dev = be.device.torch_device
        kv = new_cache(be, KVCacheSpec(1, nb, bs, KV_HEADS, hs, dt))
        impl = be.attention.make_impl(HEADS, hs, KV_HEADS, hs**-0.5)
        ctx = [(r, p) for r, (c, _) in enumerate(reqs) for p in range(c)]
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for r, p in ctx])
        rnd = lambda n, h, g=g, dev=dev, dt=dt: randn(g, n, h, hs, dtype=dtype).to(dev, dt)
        impl.write_kv(rnd(len(ctx), KV_HEADS), rnd(len(ctx), KV_HEADS), kv.layer(0), slots.to(dev))
        common = AttentionMetadata.build([1] * (n_real + pad), [c + 1 for c, _ in reqs] + [1] * pad,
                                         tables + [[0] * len(tables[0])] * pad, bs, device=dev)
        common.slot_mapping[n_real:] = -1
        md = be.attention.metadata_builder().build(common)
        q, k, v = rnd(n_real + pad, HEADS), rnd(n_real + pad, KV_HEADS), rnd(n_real + pad, KV_HEADS)
        before = [x.clone() for x in read_tokens(kv, 0)]
        impl.write_kv(k, v, kv.layer(0), common.slot_mapping)
        out = impl.forward(q, k, v, kv.layer(0), md)
        be.device.synchronize()
        outs.append(out[:n_real].float().cpu())
        real = common.slot_mapping[:n_real].cpu()
        after = read_tokens(kv, 0)
        for b, a in zip(before, after):
            keep = torch.ones(b.shape[0], dtype=torch.bool)
            keep[real] = False
            check.exact(a[keep].to(dtype), b[keep].to(dtype), "kv_write",
                        "cache outside the real rows' slots after a padded batch")
        caches.append(after)
    check.close(outs[0], outs[1], dtype, "attention", "real rows of a padded decode batch")

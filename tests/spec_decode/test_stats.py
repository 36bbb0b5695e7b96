"""Speculative decoding counters: the per-position counts (kept as histograms so that recording a verify
pass is O(1)) equal their definition — drafts verified / accepted at position ``j`` over all passes."""

from __future__ import annotations

import random

from hwkv.core.spec_stats import SpecDecodeStats


def test_per_position_counts_match_their_definition() -> None:
    rng = random.Random(0)
    for _ in range(200):
        st, drafted, accepted = SpecDecodeStats(), [], []
        for _ in range(rng.randrange(0, 30)):
            d = rng.randrange(0, 6)
            a = rng.randrange(0, d + 1)
            st.record(d, a)
            if d:
                drafted += [0] * (d - len(drafted))
                accepted += [0] * (d - len(accepted))
                for j in range(d):
                    drafted[j] += 1
                for j in range(a):
                    accepted[j] += 1
        snap = st.snapshot()
        assert st.drafted_per_pos == drafted and snap["accepted_per_position"] == accepted
        assert snap["acceptance_rate_per_position"] == [x / y for x, y in zip(accepted, drafted)]
        assert st.draft_tokens == sum(drafted) and st.accepted_tokens == sum(accepted)

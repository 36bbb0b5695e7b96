import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hwkv.spec_decode.ngram import ngram_propose


def test_longest_suffix_most_recent_occurrence() -> None:
    t = np.array([1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3])
    assert ngram_propose(t, 3, 1, 3) == [4, 5, 6]  # "1 2 3" last seen before 4 5 6
    assert ngram_propose(t, 2, 1, 3) == [4, 5]
    assert ngram_propose(np.array([5, 6, 7, 8]), 3, 1, 3) == []  # no earlier occurrence
    assert ngram_propose(np.array([7, 1, 7]), 3, 1, 2) == [1, 7]  # falls back to n = 1
    assert ngram_propose(np.array([3, 4, 3, 4]), 4, 2, 2) == [3, 4]  # continuation ends at the sequence end
    assert ngram_propose(np.array([1]), 3, 1, 3) == []
    assert ngram_propose(t, 0, 1, 3) == []


def _brute(t: list[int], k: int, lo: int, hi: int) -> list[int]:
    L = len(t)
    for n in range(min(hi, L - 1), lo - 1, -1):
        hits = [s for s in range(0, L - n) if t[s : s + n] == t[L - n :]]
        if hits:
            return t[hits[-1] + n : hits[-1] + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), min_size=0, max_size=40), st.integers(0, 5), st.integers(1, 3), st.integers(0, 3))
def test_matches_brute_force(t: list[int], k: int, lo: int, extra: int) -> None:
    assert ngram_propose(np.array(t, dtype=np.int64), k, lo, lo + extra) == (_brute(t, k, lo, lo + extra) if k else [])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=30), st.integers(0, 5)), min_size=1,
                max_size=6), st.integers(1, 3), st.integers(0, 3))
def test_batch_matches_brute_force_per_row(seqs: list[tuple[list[int], int]], lo: int, extra: int) -> None:
    """All rows at once (different lengths and caps, rows of a wider table in shuffled slots) give each
    row's own answer."""
    from hwkv.spec_decode.ngram import ngram_propose_batch

    width = max(len(t) for t, _ in seqs) + 3
    rng = np.random.default_rng(len(seqs))
    table = rng.integers(0, 4, (len(seqs) + 2, width)).astype(np.int32)  # past each row: tokens that could match
    slots = rng.permutation(len(seqs) + 2)[: len(seqs)]
    for s, (t, _) in zip(slots, seqs):
        table[s, : len(t)] = t
    lens = np.array([len(t) for t, _ in seqs])
    ks = np.array([k for _, k in seqs])
    got = ngram_propose_batch(table, slots, lens, ks, lo, lo + extra)
    assert got == [_brute(t, k, lo, lo + extra) if k else [] for t, k in seqs]

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

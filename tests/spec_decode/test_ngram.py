import numpy as np

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

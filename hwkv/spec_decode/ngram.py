"""n-gram (prompt lookup) proposer: drafts are the tokens that followed the latest earlier
occurrence of the sequence's own suffix (vLLM's ``ngram`` method; no model, host numpy)."""

from __future__ import annotations

from typing import Any

import numpy as np


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens`` (1-D ints).

    Tries suffix lengths ``n_max`` down to ``n_min``; for the first length whose suffix occurs
    earlier, returns the (up to ``k``) tokens after its most recent earlier occurrence. No match: []."""
    L = len(tokens)
    if k <= 0 or L < 2:
        return []
    # windows that could match end where the last token occurs earlier: one pass over the sequence,
    # then only those candidates are compared (the sequence can be long, the candidates are few)
    ends = np.flatnonzero(tokens[: L - 1] == tokens[L - 1])
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = ends[ends >= n - 1] - (n - 1)
        if not len(starts):
            continue
        ok = (tokens[starts[:, None] + np.arange(n)] == tokens[L - n :]).all(axis=1)
        if ok.any():
            start = int(starts[ok][-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """Proposes from each request's own token row in the runner (prompt + outputs)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, runner: Any, states: list[Any], req_ids: list[str], caps: list[int]) -> list[list[int]]:
        return [ngram_propose(runner.token_ids[st.slot, : st.num_tokens], k, self.n_min, self.n_max)
                for st, k in zip(states, caps)]

    def drop(self, req_id: str) -> None:
        pass

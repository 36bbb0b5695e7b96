"""n-gram (prompt lookup) proposer: drafts are the tokens that followed the latest earlier
occurrence of the sequence's own suffix (vLLM's ``ngram`` method; no model, host numpy).

All requests of a step are matched at once (:func:`ngram_propose_batch`): one pass over the token
rows finds where each row's last token occurred before; only those candidate positions are then
compared backwards with the suffix, ``prompt_lookup_max`` tokens each, in one gather. No per-request loop
but the final slicing of each row's drafts."""

from __future__ import annotations

from typing import Any

import numpy as np

from hwkv.engine.spec_config import ProposerTarget
from hwkv.spec_decode.proposer import Proposer, RunnerView


def ngram_propose_batch(token_ids: np.ndarray, rows: np.ndarray, lens: np.ndarray, ks: np.ndarray, n_min: int,
                        n_max: int) -> list[list[int]]:
    """Up to ``ks[i]`` draft tokens for the sequence ``token_ids[rows[i], :lens[i]]`` of every ``i``.

    Per sequence: for the largest suffix length ``n`` in ``[n_min, n_max]`` whose suffix occurs earlier,
    the (up to ``k``) tokens after its most recent earlier occurrence (they may run into the suffix
    itself, never past the sequence's end). No match, ``k <= 0`` or fewer than 2 tokens: ``[]``."""
    out: list[list[int]] = [[] for _ in range(len(rows))]
    idx = np.flatnonzero((np.asarray(ks) > 0) & (np.asarray(lens) >= 2))
    if not len(idx):
        return out
    L = np.asarray(lens, dtype=np.int64)[idx]
    W = int(L.max())
    tok = token_ids[np.asarray(rows)[idx], :W]
    n = len(idx)
    last = tok[np.arange(n), L - 1]
    # candidate windows end at an earlier occurrence of the last token (p < L - 1)
    r, p = np.nonzero((tok[:, : W - 1] == last[:, None]) & (np.arange(W - 1) < (L - 1)[:, None]))
    if not len(r):
        return out
    # how many tokens of the suffix the window ending at p matches: both sides gathered at once, [C, n_max]
    flat, js, Lr = tok.ravel(), np.arange(n_max), L[r]
    win = flat[np.maximum((r * W + p)[:, None] - js, (r * W)[:, None])]
    suf = flat[np.maximum((r * W + Lr - 1)[:, None] - js, 0)]  # off the row only where p < j: masked below
    m = np.logical_and.accumulate((win == suf) & (p[:, None] >= js), axis=1).sum(1)
    first = np.flatnonzero(np.concatenate([[True], r[1:] != r[:-1]]))  # each row's first candidate
    best = np.zeros(n, dtype=np.int64)
    best[r[first]] = np.maximum.reduceat(m, first)
    sel = (m == best[r]) & (best[r] >= n_min)
    rs, ps = r[sel], p[sel]
    if not len(rs):
        return out
    ends = np.flatnonzero(np.concatenate([rs[1:] != rs[:-1], [True]]))  # row-major: a row's last is its latest
    row, start = rs[ends], ps[ends] + 1
    k = np.asarray(ks, dtype=np.int64)[idx[row]]
    num = np.minimum(k, L[row] - start)
    K = int(num.max())
    d = tok[row[:, None], np.minimum(start[:, None] + np.arange(K), W - 1)].tolist()
    for i, dr, c in zip(idx[row].tolist(), d, num.tolist()):
        out[i] = dr[:c]
    return out


def ngram_propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """:func:`ngram_propose_batch` of one 1-D sequence."""
    t = np.asarray(tokens).reshape(1, -1)
    return ngram_propose_batch(t, np.zeros(1, np.int64), np.array([t.shape[1]]), np.array([k]), n_min, n_max)[0]


class NgramProposer(Proposer):
    """Proposes from each request's own token row in the runner (prompt + outputs)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max

    @classmethod
    def load(cls, cfg: Any, target: ProposerTarget) -> NgramProposer:
        return cls(cfg.prompt_lookup_min, cfg.prompt_lookup_max)

    def propose(self, runner: RunnerView, states: list[Any], req_ids: list[str], caps: Any) -> list[list[int]]:
        n = len(states)
        rows = np.fromiter((st.slot for st in states), dtype=np.int64, count=n)
        lens = np.fromiter((st.num_tokens for st in states), dtype=np.int64, count=n)
        return ngram_propose_batch(runner.token_ids, rows, lens, np.asarray(caps), self.n_min, self.n_max)

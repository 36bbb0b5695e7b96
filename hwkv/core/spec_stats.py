"""Speculative decoding counters the scheduler keeps as it verifies drafts (``engine.stats()["spec_decode"]``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify passes of a request with at least one draft
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    emitted_tokens: int = 0  # tokens those verify passes produced (accepted + 1 each)
    # [n]: verify passes with exactly n drafts / n accepted (per position counts are their tail sums:
    # recording a pass is then O(1), it runs per request per step)
    drafted_hist: list[int] = field(default_factory=list)
    accepted_hist: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_accepted + 1
        dh, ah = self.drafted_hist, self.accepted_hist
        if num_draft >= len(dh):
            grow = [0] * (num_draft + 1 - len(dh))
            dh += grow
            ah += grow
        dh[num_draft] += 1
        ah[num_accepted] += 1

    @property
    def drafted_per_pos(self) -> list[int]:
        """``[j]``: drafts verified at position ``j``."""
        return _tails(self.drafted_hist)

    @property
    def accepted_per_pos(self) -> list[int]:
        """``[j]``: drafts accepted at position ``j``."""
        return _tails(self.accepted_hist)[: len(self.drafted_hist) - 1]

    def snapshot(self) -> dict[str, Any]:
        return {
            "num_drafts": self.num_drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            # tokens per verify pass of a drafting request (1 = drafts never helped)
            "mean_accepted_length": self.emitted_tokens / self.num_drafts if self.num_drafts else 0.0,
            "acceptance_rate_per_position": [a / d if d else 0.0
                                             for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)],
            "accepted_per_position": self.accepted_per_pos,
        }


def _tails(hist: list[int]) -> list[int]:
    """``[j]`` = passes whose count exceeds ``j``: ``sum(hist[j + 1:])``, for ``j < len(hist) - 1``."""
    out, acc = [], 0
    for c in reversed(hist[1:]):
        acc += c
        out.append(acc)
    return out[::-1]

"""Speculative decoding counters (``engine.stats()["spec_decode"]``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verify passes of a request with at least one draft
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    emitted_tokens: int = 0  # tokens those verify passes produced (accepted + 1 each)
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j
    drafted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts verified at position j

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        self.num_drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        self.emitted_tokens += num_accepted + 1
        grow = num_draft - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for j in range(num_draft):
            self.drafted_per_pos[j] += 1
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

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
            "accepted_per_position": list(self.accepted_per_pos),
        }

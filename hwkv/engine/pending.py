"""Async stepping: a launched step whose sampled tokens the host has not read yet, and the device
copy that feeds those tokens into the next step's inputs (see :mod:`hwkv.engine.model_runner`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hwkv.core.sched_output import ModelRunnerOutput, SchedulerOutput

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class Pending:
    """A launched step's output; ``tokens`` (device, int64 ``[S]``, row ``j`` ↔ ``states[j]``) is
    set until the host has read and recorded them."""

    out: ModelRunnerOutput
    states: list[Any] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None  # pinned copy of ``tokens`` (CUDA), valid once ``event`` fired
    event: Any = None

    def rows(self, states: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """``(batch rows, token rows)`` of the states whose next input is one of these unread tokens."""
        if self.tokens is None:
            return EMPTY, EMPTY
        row = {id(st): j for j, st in enumerate(self.states)}
        pairs = [(i, j) for i, st in enumerate(states) if (j := row.get(id(st))) is not None]
        if not pairs:
            return EMPTY, EMPTY
        a = np.array(pairs, dtype=np.int64)
        return a[:, 0], a[:, 1]


def first_token_index(so: SchedulerOutput, rows: np.ndarray) -> np.ndarray:
    """Index of each of ``rows``' first scheduled token in the flattened batch."""
    ql = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(so.num_scheduled_tokens))
    start = np.zeros(len(ql), dtype=np.int64)
    np.cumsum(ql[:-1], out=start[1:])
    return start[rows]


def fill_tokens(input_ids: torch.Tensor, at: np.ndarray, src: np.ndarray, tokens: torch.Tensor) -> None:
    """``input_ids[at] = tokens[src]`` on the device (one copy when both are the same prefix)."""
    k = len(at)
    if at[-1] == k - 1 and np.array_equal(at, src):  # rows ascend and are distinct: both are arange(k)
        input_ids[:k].copy_(tokens[:k])
        return
    idx = torch.from_numpy(np.stack([at, src]))
    if input_ids.device.type == "cuda":
        idx = idx.pin_memory().to(input_ids.device, non_blocking=True)
    input_ids.index_copy_(0, idx[0], tokens.index_select(0, idx[1]))

"""Async stepping: a launched step whose sampled tokens the host has not read yet, and the device
copy that feeds those tokens into the next step's inputs (see :mod:`hwkv.engine.model_runner`)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hwkv.core.sched_output import ModelRunnerOutput
from hwkv.interfaces.device import Device

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class Pending:
    """A launched step's output; ``tokens`` (device, int64 ``[S]``, row ``j`` ↔ ``states[j]``) is
    set until the host has read and recorded them."""

    out: ModelRunnerOutput
    states: list[Any] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None  # host copy of ``tokens`` (Device.to_host_async), valid once ``event`` fired
    event: Any = None
    num_drops: int = -1  # the runner's drop count at launch (equal later: every state is still held)
    # the tokens came from a decode graph of the runner ``made_by`` that also wrote them into the ids row of the
    # runner ``ids_in``, row j at j (hwkv.engine.graph_runner); ``None``: not so
    made_by: Any = None
    ids_in: Any = None

    def rows(self, states: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """``(batch rows, token rows)`` of the states whose next input is one of these unread tokens."""
        if self.tokens is None:
            return EMPTY, EMPTY
        n = len(states)
        if n == len(self.states) and all(map(operator.is_, states, self.states)):  # steady decoding
            a = np.arange(n, dtype=np.int64)
            return a, a
        row = {id(st): j for j, st in enumerate(self.states)}
        pairs = [(i, j) for i, st in enumerate(states) if (j := row.get(id(st))) is not None]
        if not pairs:
            return EMPTY, EMPTY
        a = np.array(pairs, dtype=np.int64)
        return a[:, 0], a[:, 1]


def fill_tokens(input_ids: torch.Tensor, at: np.ndarray, src: np.ndarray, tokens: torch.Tensor,
                device: Device) -> None:
    """``input_ids[at] = tokens[src]`` on the device (one copy when both are the same prefix)."""
    k = len(at)
    if at[-1] == k - 1 and np.array_equal(at, src):  # rows ascend and are distinct: both are arange(k)
        input_ids[:k].copy_(tokens[:k])
        return
    idx = device.to_device(torch.from_numpy(np.stack([at, src])))
    input_ids.index_copy_(0, idx[0], tokens.index_select(0, idx[1]))

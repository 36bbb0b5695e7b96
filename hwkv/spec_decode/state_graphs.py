"""Graphs of the target that also return the states an EAGLE head reads.

An EAGLE step needs, besides the logits, the target's states at every query token (the final normed
hidden state for EAGLE-1, the residual streams entering three layers for EAGLE-3). A graph has one
output, so :class:`StatesGraphRunner` captures ``logits | states`` as one float32 tensor
``[tokens, vocab + S]`` (the states cast to float32 and back: exact for 16-bit activations);
:func:`split` takes it apart. Everything else — buckets, static buffers, padding, replay — is the
plain :class:`~hwkv.engine.graph_runner.GraphRunner`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hwkv.engine.graph_runner import GraphRunner


class StatesGraphRunner(GraphRunner):
    """``states(model, h)``: the proposer's target states from the final hidden states ``h [T, H]``
    (read inside the forward, so hooks on the target's layers run inside the capture)."""

    def __init__(self, *args: Any, states: Callable[[Any, torch.Tensor], torch.Tensor], **kwargs: Any):
        super().__init__(*args, **kwargs)
        if self.last_only:
            raise ValueError("StatesGraphRunner serves every query token (last_only is not supported)")
        self.states = states

    def _forward(self, b: int, md: Any) -> torch.Tensor:
        t, m = b * self.q, self.model
        h = m.forward_hidden(self.d64[0, :t], self.d64[1, :t], self.kv_cache, md, self.d64[2, :t])
        logits = m.compute_logits(h, self.logits_indices[:t])
        return torch.cat([logits, self.states(m, h).float()], -1)


def split(packed: torch.Tensor, vocab: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [T, vocab] float32, states [T, S] in dtype)`` of a :class:`StatesGraphRunner` output."""
    return packed[:, :vocab], packed[:, vocab:].to(dtype)


class HeadGraphRunner(GraphRunner):
    """Graphs of an EAGLE head's one-token draft steps: each row feeds one pair (its last draft, the
    head's own state) and gets the head's output state ``[n, H]``. The pair's state has its own static
    buffer, filled with the token ids after the inputs are copied in (``run(batch, fill)`` with
    :meth:`feeder`)."""

    def __init__(self, head: Any, *args: Any, **kwargs: Any):
        super().__init__(head, *args, **kwargs)
        if self.q != 1 or self.last_only:
            raise ValueError("HeadGraphRunner serves one-token draft steps (query_len 1) only")
        h = head.config.hidden_size
        self.states = torch.zeros((self.max_batch, h), dtype=head.fc.weight.dtype, device=self.device.torch_device)

    def _forward(self, b: int, md: Any) -> torch.Tensor:
        return self.model(self.d64[0, :b], self.states[:b], self.d64[1, :b], self.kv_cache, md, self.d64[2, :b])

    def feeder(self, tokens: torch.Tensor, states: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """The ``fill`` of a step whose ``n`` rows feed ``tokens [n]`` and ``states [n, H]`` (on the device)."""
        n = tokens.shape[0]

        def fill(ids: torch.Tensor) -> None:
            ids[:n].copy_(tokens)
            self.states[:n].copy_(states)
        return fill

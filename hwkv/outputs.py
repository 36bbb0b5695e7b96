"""What the engine returns for a request: cumulative text and tokens, finish reason, timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionMetrics:
    """Monotonic-clock timestamps (``time.monotonic()``), in seconds."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache / a connector
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """Cumulative output of one request (streaming steps return it again as it grows).

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string — then ``stop_reason``
    names it), ``"length"`` (max_tokens or max_model_len), ``"abort"`` or ``"error"`` (executing
    the request failed; ``error`` says how); ``None`` while running.
    ``text`` excludes a matched stop string; ``token_ids`` include the token that completed it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: CompletionMetrics
    stop_reason: int | str | None = None
    logprobs: list[Any] | None = None
    kv_transfer_params: dict[str, Any] | None = field(default=None, repr=False)
    error: str | None = None  # finish_reason "error": the exception that ended the request
    # SamplingParams.prompt_logprobs: per prompt token {token: (logprob, rank)}, the first None; set
    # once the prompt is computed (with the first output token)
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    def __repr__(self) -> str:
        return (
            f"RequestOutput({self.request_id!r}, text={self.text!r}, tokens={len(self.token_ids)}, "
            f"finished={self.finished}, finish_reason={self.finish_reason!r})"
        )

"""The scheduler's configuration: its engine options as given (:class:`SchedulerOptions`, one group
of :class:`hwkv.engine.config.EngineArgs`) and as the scheduler runs them (:class:`SchedulerConfig`),
validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

from hwkv.core.sched_policy import POLICIES


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(kw_only=True)
class SchedulerOptions:
    max_num_seqs: int | None = None  # requests running at once; None: by device and entry point (engine/defaults.py)
    max_num_batched_tokens: int | None = None  # tokens per step; None: by device and entry point (>= max_model_len
    # without chunking)
    enable_chunked_prefill: bool = True  # split long prompts over steps, mixed with decodes
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step
    max_num_partial_prefills: int = 1  # requests allowed to be mid-prefill at once
    # A waiting request whose whole rest fits this step may start while one ahead of it waits for a
    # partial-prefill slot (vLLM's short prompts jumping the queue, max_long_partial_prefills): with
    # long_prefill_token_threshold, a prefix-cache hit's few tokens then need not wait out a long miss.
    short_prefills_first: bool = False
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (lower SamplingParams.priority first, preempting)
    # Admit a waiting request only when its whole prompt (after prefix-cache hits) fits in free blocks,
    # not just its first chunk (vLLM's scheduler_reserve_full_isl). Off: larger batches, but more
    # admit-then-preempt under memory pressure. Provisional default from the CPU measurement
    # (docs/engine.md, "Admission measurements"); the GPU run decides.
    reserve_full_prompt: bool = True

    def check(self) -> None:
        """Types and ranges of the options as given (``None``: the engine chooses)."""
        if not (_is_int(self.max_num_partial_prefills) and self.max_num_partial_prefills >= 1):
            raise ValueError(f"max_num_partial_prefills must be an int >= 1, got {self.max_num_partial_prefills!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not (v is None or (_is_int(v) and v >= 1)):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        t = self.long_prefill_token_threshold
        if not (_is_int(t) and t >= 0):
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0, got {t!r}")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {self.scheduling_policy!r}")
        for name in ("enable_chunked_prefill", "reserve_full_prompt", "short_prefills_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(kw_only=True)
class SchedulerConfig(SchedulerOptions):
    """What the scheduler runs with: the options, the token budget chosen, and what other groups decide."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    async_scheduling: bool = False  # plan step N+1 before step N's tokens arrive (placeholders)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off, or a long prompt could never run"
            )
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {self.scheduling_policy!r}")
        if not isinstance(self.reserve_full_prompt, bool):
            raise ValueError(f"reserve_full_prompt must be a bool, got {self.reserve_full_prompt!r}")

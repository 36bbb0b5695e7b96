"""SchedulerConfig: the scheduler's knobs, validated with errors that name the field."""

from __future__ import annotations

from dataclasses import dataclass

from hwkv.core.sched_policy import POLICIES


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step
    max_num_partial_prefills: int = 1  # requests allowed to be mid-prefill at once
    async_scheduling: bool = False  # plan step N+1 before step N's tokens arrive (placeholders)
    policy: str = "fcfs"  # "fcfs" | "priority" (hwkv.core.sched_policy)
    # Admit a waiting request only when its whole prompt (after prefix-cache hits) fits in free blocks,
    # not just its first chunk (vLLM's scheduler_reserve_full_isl). Off: larger batches, but more
    # admit-then-preempt under memory pressure. Provisional default from the CPU measurement
    # (docs/engine.md, "Admission measurements"); the GPU run decides.
    reserve_full_prompt: bool = True

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
        if self.policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if not isinstance(self.reserve_full_prompt, bool):
            raise ValueError(f"reserve_full_prompt must be a bool, got {self.reserve_full_prompt!r}")

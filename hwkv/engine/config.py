"""EngineConfig: every Engine knob in one validated place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineConfig:
    model: str
    backend: Any = "cpu"  # a registered backend name, or a Backend instance (emulators, tests)
    dtype: Any = None  # None/"auto": the checkpoint's dtype (float32 when it names none)
    max_model_len: int | None = None  # None: the model's, capped by the KV pool
    block_size: int | None = None  # None: the backend's default
    num_kv_blocks: int | None = None  # None: memory_fraction of free device memory
    memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len when chunked prefill is off
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    seed: int = 0
    enforce_eager: bool = False  # True: never capture CUDA graphs (every step runs eagerly)
    fuse_elementwise: bool | None = None  # torch.compile RMSNorm/RoPE/SiLU·mul; None: when graphs are on
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: when graphs are on
    prefetch_weights: bool | None = None  # Device.prefetch hints in the plain (not decode-ops) forward; None/False: off
    decode_ops: bool | None = None  # the backend's fused DecodeOps for forwards of few tokens; None: if offered
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (per-request priority, lower first)
    reserve_full_prompt: bool = True  # admit a waiting request only when its whole prompt fits in free blocks

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need("backend", (isinstance(self.backend, str) and bool(self.backend)) or hasattr(self.backend, "attention"),
             "a backend name or a Backend instance")
        for name in ("max_num_seqs", "max_num_partial_prefills"):
            need(name, is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        for name in ("max_model_len", "block_size", "num_kv_blocks", "max_num_batched_tokens"):
            v = getattr(self, name)
            need(name, v is None or (is_int(v) and v >= 1), "None or an int >= 1")
        need("memory_fraction", isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1,
             "in (0, 1]")
        need("long_prefill_token_threshold",
             is_int(self.long_prefill_token_threshold) and self.long_prefill_token_threshold >= 0, "an int >= 0")
        need("seed", is_int(self.seed), "an int")
        need("enforce_eager", isinstance(self.enforce_eager, bool), "a bool")
        for name in ("fuse_elementwise", "async_scheduling", "prefetch_weights", "decode_ops"):
            need(name, getattr(self, name) is None or isinstance(getattr(self, name), bool), "None or a bool")
        from hwkv.core.sched_policy import POLICIES

        need("scheduling_policy", self.scheduling_policy in POLICIES, f"one of {sorted(POLICIES)}")
        need("reserve_full_prompt", isinstance(self.reserve_full_prompt, bool), "a bool")

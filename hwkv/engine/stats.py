"""Engine counters: tokens processed, time spent stepping, throughput."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hwkv.core.sched_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class EngineStats:
    num_steps: int = 0
    prompt_tokens: int = 0  # prefill (and recompute) tokens computed
    generation_tokens: int = 0  # tokens sampled
    busy_s: float = 0.0  # wall time inside step()

    def record_step(self, so: SchedulerOutput, ro: ModelRunnerOutput, requests: dict[str, Any]) -> None:
        """Count this step's tokens; call before ``update_from_output`` (finished requests leave
        ``requests`` there)."""
        if so.total_num_scheduled_tokens == 0:
            return
        self.num_steps += 1
        # A decode computes one token past the prompt of an already-running request; everything
        # else scheduled (prompt chunks, recompute after preemption) is prefill work.
        cached, sched = so.scheduled_cached_reqs, so.num_scheduled_tokens
        # (a speculative verify of k drafts is k + 1 decode tokens)
        spec = so.scheduled_spec_decode_tokens
        n_decode = 0
        for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
            n = sched[rid]
            if n == 1 + (len(spec.get(rid, ())) if spec else 0) and (r := requests.get(rid)) is not None \
                    and c >= len(r.prompt_token_ids):
                n_decode += n
        self.prompt_tokens += so.total_num_scheduled_tokens - n_decode
        self.generation_tokens += sum(map(len, ro.sampled_token_ids.values()))

    def snapshot(self, *, kv_usage: float, num_kv_blocks: int, num_free_blocks: int, prefix_stats: Any,
                 num_preemptions: int, num_running: int, num_waiting: int) -> dict[str, Any]:
        t = self.busy_s or float("inf")
        return {
            "num_running": num_running,
            "num_waiting": num_waiting,
            "kv_usage": kv_usage,
            "num_kv_blocks": num_kv_blocks,
            "num_free_blocks": num_free_blocks,
            "prefix_cache_queries": prefix_stats.queries,
            "prefix_cache_hits": prefix_stats.hits,
            "prefix_cache_hit_rate": prefix_stats.hit_rate,
            "num_preemptions": num_preemptions,
            "num_steps": self.num_steps,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "busy_s": self.busy_s,
            "prompt_tokens_per_s": self.prompt_tokens / t,
            "generation_tokens_per_s": self.generation_tokens / t,
        }

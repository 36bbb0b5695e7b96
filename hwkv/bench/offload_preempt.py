"""`hwkv bench offload --parts preempt`, and the connector's host time per step for the other parts.

(preempt) a device pool too small for the batch (``--preempt-blocks``; default: a third of what the
          requests need at full length), connector on vs off. A preempted request's computed full
          blocks go to the host tier before its blocks are reused, so its re-admission loads them
          instead of recomputing: tokens computed, throughput, preemptions, external-hit tokens and
          preempted-store blocks, on vs off, and whether the greedy tokens matched.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench.common import free_engine, offload_engine

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "request_preempted", "bind_connector_metadata", "start_load_kv", "wait_for_save",
         "get_finished")


class HookTimer:
    """Host seconds spent inside a connector's hooks (scheduler and worker side) since ``reset``."""

    def __init__(self, conn: Any):
        self.s = 0.0
        for name in HOOKS:
            setattr(conn, name, self._wrap(getattr(conn, name)))

    def _wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.s += time.perf_counter() - t0
        return timed

    def reset(self) -> None:
        self.s = 0.0


def _count_scheduled(scheduler: Any) -> list[int]:
    """``[tokens scheduled so far]`` (prompt, recomputed and decoded alike), counted from now on."""
    computed, schedule = [0], scheduler.schedule

    def counted() -> Any:
        so = schedule()
        computed[0] += so.total_num_scheduled_tokens
        return so

    scheduler.schedule = counted
    return computed


def bench_preempt(args: argparse.Namespace, mdir: Path, block_size: int) -> dict[str, Any]:
    n, plen, olen = args.preempt_requests, args.decode_prompt, args.decode_tokens
    blocks = args.preempt_blocks or max(n * -(-(plen + olen) // block_size) // 3, -(-(plen + olen) // block_size) + 1)
    out: dict[str, Any] = {"requests": n, "prompt_len": plen, "output_len": olen, "device_blocks": blocks}
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    for offload in (False, True, False, True):  # interleaved: drift hits both alike
        key = "on" if offload else "off"
        e = offload_engine(mdir, args, offload, max_model_len=plen + olen + 16, max_num_seqs=n, num_kv_blocks=blocks)
        rng = random.Random(2)  # distinct random prompts: only a preempted request's own blocks can hit
        prompts = [[rng.randrange(100, e.vocab_size - 100) for _ in range(plen)] for _ in range(n)]
        e.generate(prompts[:1], hwkv.SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        computed = _count_scheduled(e.scheduler)
        steps0, pre0 = e.stats()["num_steps"], e.scheduler.num_preemptions
        e.backend.device.synchronize()
        t0 = time.perf_counter()
        got = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
        e.backend.device.synchronize()
        tps = n * olen / (time.perf_counter() - t0)
        tokens.setdefault(key, got)
        row = {"tok_per_s": round(tps, 1), "tokens_computed": computed[0], "steps": e.stats()["num_steps"] - steps0,
               "preemptions": e.scheduler.num_preemptions - pre0}
        if offload:
            st = e.stats()["kv_connector"]
            row.update({k: st[k] for k in ("external_hit_tokens", "preempted_store_blocks", "stores_skipped_full")})
        prev = out.get(key)
        if prev is None or row["tok_per_s"] > prev["tok_per_s"]:
            out[key] = row
        free_engine(e, e.backend.device)
    out["tokens_identical"] = tokens["on"] == tokens["off"]
    out["speedup"] = round(out["on"]["tok_per_s"] / out["off"]["tok_per_s"], 4)
    on, off = out["on"], out["off"]
    print(f"preempt {n} x ({plen} + {olen}) tokens, {blocks} device blocks: off {off['tok_per_s']} tok/s, "
          f"{off['tokens_computed']} tokens computed, {off['preemptions']} preemptions; on {on['tok_per_s']} tok/s, "
          f"{on['tokens_computed']} computed, {on['preemptions']} preemptions, {on['external_hit_tokens']} from the "
          f"host tier ({on['preempted_store_blocks']} blocks stored at preemption); tokens identical: "
          f"{out['tokens_identical']}", flush=True)
    return out

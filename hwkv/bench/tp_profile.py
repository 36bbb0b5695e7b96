"""``hwkv bench tp --profile PREFIX``: where each rank's GPU time goes, per step, in three phases of an
engine already built (:mod:`hwkv.bench.tp`):

* ``decode_b1``: batch-1 decode steps (graph replays), the issue's batch-1 figure;
* ``prefill``: ``N`` prompts of ``IN`` tokens, one output token each: the offline run's prefill steps at
  the engine's token budget (at tp > 1 the large all-reduces run on NCCL);
* ``decode_bN``: the offline run's decode steps, all ``N`` requests running.

Each rank (the driver and every worker, :mod:`hwkv.engine.tp.profile`) records the same steps and
reports per step: span, GPU busy and idle, critical time per kind (GEMM, attention, NCCL, the push
all-reduce, ...) and the top kernels (calls per step, µs per call). The driver also gives its wall
time per step. A table per rank goes to stdout; the whole goes into the result JSON.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from hwkv.engine.tp import messages as m
from hwkv.engine.tp import profile as kp
from hwkv.sampling_params import SamplingParams

FILE_WAIT_S = 60.0


def _window(e: Any, path: str, run: Any) -> dict[str, Any]:
    """Profile every rank over ``run()`` (which returns after its steps); per-rank summaries."""
    tp = e._tp
    if tp is not None:
        tp.send(m.Profile())  # in the step stream: the workers start before the window's first step
    prof = kp.KernelProfile(e.backend.device)
    s0 = e._stats.num_steps
    prof.start()
    t0 = time.perf_counter()
    run()
    e.backend.device.synchronize()
    wall = time.perf_counter() - t0
    steps = e._stats.num_steps - s0
    ranks = [prof.stop(steps)]
    kp.write(path, 0, ranks[0])
    if tp is not None:
        tp.send(m.Profile(path))
        for r in range(1, tp.comm.world_size):
            f, deadline = f"{path}.rank{r}.json", time.monotonic() + FILE_WAIT_S
            while not os.path.exists(f) and time.monotonic() < deadline:
                tp.check()
                time.sleep(0.05)
            time.sleep(0.2)  # written in one go; let it finish
            ranks.append(json.loads(Path(f).read_text()) if os.path.exists(f) else {"missing": f})
    return {"driver_wall_ms_per_step": round(wall * 1e3 / max(steps, 1), 3), "steps": steps, "ranks": ranks}


def _steps(e: Any, n: int) -> None:
    for _ in range(n):
        e.step()


def _drain(e: Any, ids: list[str]) -> None:
    e.abort(ids)
    deadline = time.monotonic() + 60
    while e.has_unfinished() and time.monotonic() < deadline:
        e.step()


def profile_engine(e: Any, prompts: Any, prefix: str, offline: str, decode_steps: int = 32) -> dict[str, Any]:
    """``prompts(n, length, seed)``: token-id prompts (a new seed per phase: no prefix-cache hits)."""
    cfg = e.config
    max_len = cfg.model.max_model_len
    res: dict[str, Any] = {"config": {
        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens, "max_num_seqs": cfg.scheduler.max_num_seqs,
        "num_kv_blocks": getattr(cfg.cache, "num_kv_blocks", None),
        "block_size": getattr(cfg.cache, "block_size", None),
        "graphs": e.runner.graphs is not None, "decode_ops": e.model.decode_ops is not None}}
    print(f"[profile] {res['config']}", flush=True)
    # batch-1 decode: a request past its prefill, then the window of decode steps
    e.add_request("prof-b1", prompts(1, 32, 11)[0], SamplingParams(temperature=0.0, max_tokens=max_len - 32,
                                                                   ignore_eos=True))
    _steps(e, 4)
    res["decode_b1"] = _window(e, f"{prefix}-decode_b1", lambda: _steps(e, decode_steps))
    _drain(e, ["prof-b1"])
    if offline:
        n, i, _ = (int(x) for x in offline.split(":"))
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ps = prompts(n, i, 12)
        res["prefill"] = _window(e, f"{prefix}-prefill",
                                 lambda: e.generate(ps, one, use_tqdm=False))
        ids = [f"prof-bn-{k}" for k in range(n)]
        sp = SamplingParams(temperature=0.0, max_tokens=max_len - i, ignore_eos=True)
        for rid, p in zip(ids, prompts(n, i, 13)):
            e.add_request(rid, p, sp)
        _steps(e, math.ceil(n * i / cfg.scheduler.max_num_batched_tokens) + 3)  # every request past its prefill
        res[f"decode_b{n}"] = _window(e, f"{prefix}-decode_b{n}", lambda: _steps(e, 16))
        _drain(e, ids)
    for phase, r in res.items():
        if phase == "config":
            continue
        print(f"[profile] {phase}: driver wall {r['driver_wall_ms_per_step']} ms/step over {r['steps']} steps",
              flush=True)
        for rank, s in enumerate(r["ranks"]):
            print(kp.table(s, f"  rank {rank}"), flush=True)
    return res

"""`hwkv bench spec --host`: the host path of a speculative step against a plain decode step.

As ``hwkv bench host``: the real Engine, Scheduler and runners on the CPU reference backend with
emulated graph capture (verify graphs, the draft model's graphs) and a stub forward
(:func:`hwkv.bench.host.stub_forward`: next token = a function of the input token, a few ops), so
device work is negligible and what is left is the host's. Per scenario and batch size, per engine
step (process CPU time, robust to a busy shared host; the best of ``--repeat`` runs):

* ``step_ms``: the whole ``engine.step()``; ``tokens_per_step``: tokens emitted per request;
* ``propose_ms``: the proposer (for ``self`` its draft model's forwards, emulated replays included);
* ``host_ms``: the step less the proposer and the emulated graph replays — the verify path's host work;
* ``ops``: torch ops dispatched per step outside graph replays and the proposer: on a GPU each is a
  kernel launch (several µs of host time), and each host read of a device value a synchronisation.

Scenarios: ``decode`` (no speculation, synchronous: what a verify step should cost), ``ngram``
(prompts that follow the stub's token cycle with a quarter of the tokens replaced: drafts partly
right) and ``self`` (the draft model is the stub target: acceptance 1).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import hwkv


def _engine(scenario: str, batch: int, k: int, workdir: Path, max_len: int) -> Any:
    from hwkv.bench.host import VOCAB, make_engine, stub_forward
    from hwkv.reference.graphs import GraphCpuBackend

    if scenario == "decode":
        return make_engine(max(batch, 2), max_len, True, workdir, async_scheduling=False)
    make_engine(2, max_len, True, workdir)  # writes the model
    spec: dict[str, Any] = {"method": "draft_model", "num_speculative_tokens": k, "model": str(workdir / "tiny")}
    if scenario == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    e = hwkv.Engine(str(workdir / "tiny"), backend=GraphCpuBackend(), block_size=16, max_model_len=max_len,
                    num_kv_blocks=max(batch, 2) * -(-max_len // 16) + 16, max_num_seqs=max(batch, 2),
                    max_num_batched_tokens=8192, fuse_elementwise=False, speculative_config=spec)
    e.model.forward = stub_forward(VOCAB)
    if scenario == "self":
        e.proposer.model.forward = stub_forward(VOCAB)
    e.runner.enable_graphs(e.config.runtime.graph_max_batch)  # capture the stub
    return e


def measure(scenario: str, batch: int, k: int = 4, steps: int = 100, prompt_len: int = 128) -> dict[str, float]:
    """One run of ``scenario`` at ``batch`` (module doc)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from hwkv.bench.host import VOCAB
    from hwkv.reference.graphs import RecordedGraph
    from hwkv.sampling_params import SamplingParams

    clock = time.process_time
    acc = {"replay": 0.0, "ops": 0, "proposing": False, "propose": 0.0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            acc["ops"] += 1
            return func(*args, **(kwargs or {}))

    orig = RecordedGraph.replay

    def replay(self: RecordedGraph) -> None:
        t = clock()
        with _disable_current_modes():
            orig(self)
        if not acc["proposing"]:  # the proposer's replays are in its own time
            acc["replay"] += clock() - t

    with tempfile.TemporaryDirectory() as tmp:
        max_len = prompt_len + (k + 1) * (steps + 20) + 16
        e = _engine(scenario, batch, k, Path(tmp), max_len)
        r = e.runner
        prop = getattr(r, "proposer", None)
        if prop is not None:
            inner = prop.propose

            def propose(*a: Any) -> Any:
                acc["proposing"], t = True, clock()
                try:
                    with _disable_current_modes():
                        return inner(*a)
                finally:
                    acc["proposing"] = False
                    acc["propose"] += clock() - t
            prop.propose = propose
        rng = random.Random(3)
        params = SamplingParams(temperature=0.0, max_tokens=max_len - prompt_len, ignore_eos=True)
        for i in range(batch):  # the stub's own token chain, a quarter of it replaced: n-gram drafts are partly right
            x, prompt = rng.randrange(VOCAB), []
            for _ in range(prompt_len):
                prompt.append(x if rng.random() > 0.25 else rng.randrange(VOCAB))
                x = (7 * x + 1) % VOCAB
            e.add_request(f"r{i}", prompt, params)
        for _ in range(5):
            e.step()
        RecordedGraph.replay = replay  # type: ignore[method-assign]
        try:
            with Count():
                for _ in range(5):
                    e.step()
            ops = acc["ops"] / 5
            acc["replay"] = acc["propose"] = 0.0
            n0 = sum(len(st.output_token_ids) for st in r.reqs.values())
            torch.set_num_threads(1)
            t0 = clock()
            for _ in range(steps):
                e.step()
            wall = clock() - t0
        finally:
            RecordedGraph.replay = orig  # type: ignore[method-assign]
        assert len(r.reqs) == batch, "a request finished inside the timed steps"
        n = sum(len(st.output_token_ids) for st in r.reqs.values()) - n0
        proposer = acc["propose"]
        st = e.stats().get("spec_decode", {})
    return {"acceptance": st.get("acceptance_rate", 0.0), "step_ms": wall / steps * 1e3,
            "tokens_per_step": n / steps / batch, "propose_ms": proposer / steps * 1e3,
            "host_ms": (wall - proposer - acc["replay"]) / steps * 1e3,
            "ops": ops}


def run(args: argparse.Namespace) -> int:
    k = args.num_speculative_tokens
    scen = ["decode", *[s for s in args.scenarios.split(",") if s in ("ngram", "self")]]
    print(f"host path per engine step (CPU, emulated graphs, stub forward; process time, best of {args.repeat}), "
          f"k={k}")
    print("| scenario | batch | step ms | tokens/step/request | acceptance | propose ms | "
          "host ms (excl. proposer, replays) | torch ops/step |")
    print("|---|---|---|---|---|---|---|---|")
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        for s in scen:
            best = min((measure(s, b, k) for _ in range(args.repeat)), key=lambda m: m["step_ms"])
            print(f"| {s} | {b} | {best['step_ms']:.3f} | {best['tokens_per_step']:.2f} | {best['acceptance']:.2f} | "
                  f"{best['propose_ms']:.3f} | "
                  f"{best['host_ms']:.3f} | {best['ops']:.0f} |", flush=True)
    return 0

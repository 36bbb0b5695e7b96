"""`hwkv bench host`: the engine's host path per decode step, with device work made negligible.

The real Engine, Scheduler and ModelRunner run on the CPU reference backend with emulated graph
capture (:class:`hwkv.reference.graphs.GraphCpuBackend`: the graph decode path and async scheduling,
as on a GPU), but the model's forward is a stub that returns one-hot logits (next token = a
function of the input token) in a few tensor ops. What is left of a step is what the host does
per step on any device: scheduling, building inputs, staging them into the graph buffers,
sampling, reading tokens, applying them, outputs and stats. Phases are those of ``hwkv bench e2e``'s
profile (:data:`hwkv.bench.e2e_report.PHASES`), exclusive times, so they add up to the step.

``--cprofile`` adds the top functions by own time (cProfile) for each batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hwkv

VOCAB = 512


def stub_forward(vocab: int) -> Any:
    """A capturable forward whose cost does not grow with the model: logits one-hot at
    ``(7 * input + 1) % vocab`` for the rows in ``logits_indices`` (every row when ``None``, as the
    model's contract says and the graph runner's every-row graphs pass)."""
    import torch

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any, md: Any,
                logits_indices: torch.Tensor | None, slot_mapping: Any = None) -> torch.Tensor:
        rows = input_ids if logits_indices is None else input_ids.index_select(0, logits_indices)
        nxt = (rows * 7 + 1) % vocab
        return torch.zeros(rows.shape[0], vocab).scatter_(1, nxt.unsqueeze(1), 1.0)
    return forward


def make_engine(max_batch: int, max_model_len: int, graphs: bool, workdir: Path, **kw: Any) -> Any:
    """An Engine on the emulated-graph CPU backend with :func:`stub_forward` (graphs re-captured
    over the stub); ``graphs=False``: the plain eager CPU backend, synchronous."""
    from hwkv.model.tiny import write_tiny_model
    from hwkv.reference.graphs import GraphCpuBackend

    mdir = workdir / "tiny"
    if not (mdir / "config.json").exists():
        write_tiny_model(mdir, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=VOCAB,
                         max_position_embeddings=max_model_len, tokenizer=False)
    backend = GraphCpuBackend() if graphs else "cpu"
    blocks = max_batch * -(-max_model_len // 16) + 16
    e = hwkv.Engine(str(mdir), backend=backend, block_size=16, num_kv_blocks=blocks, max_model_len=max_model_len,
                    max_num_seqs=max_batch, max_num_batched_tokens=max(8192, max_batch), fuse_elementwise=False,
                    enforce_eager=not graphs, **kw)
    e.model.forward = stub_forward(VOCAB)
    if e.runner.graphs is not None:
        e.runner.enable_graphs(e.config.runtime.graph_max_batch)  # capture the stub
    return e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="64,256", help="comma list of decode batch sizes")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--eager", action="store_true", help="plain CPU backend: no graphs, synchronous steps")
    p.add_argument("--repeat", type=int, default=3, help="runs per batch size; the fastest is kept")
    p.add_argument("--wall", action="store_true",
                   help="time wall-clock (default: this process's CPU time, robust to a busy shared host)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N functions (own time)")
    p.add_argument("--out", default=None, help="write the JSON result here")


def run(args: argparse.Namespace) -> int:
    import torch

    from hwkv.bench.e2e_report import profile

    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    clock = time.perf_counter if args.wall else time.process_time
    max_len = args.prompt_len + args.steps + 64
    res: dict[str, Any] = dict(bench="host", clock="wall" if args.wall else "process CPU time",
                               mode="eager" if args.eager else "graphs + async (emulated)",
                               steps=args.steps, prompt_len=args.prompt_len,
                               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), profile={})
    with tempfile.TemporaryDirectory() as tmp:
        engine = make_engine(max(batches), max_len, not args.eager, Path(tmp))
        for b in batches:
            runs = [profile(engine, VOCAB, b, args.steps, args.prompt_len, gpu=False, clock=clock)
                    for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["step_wall"])
            res["profile"][f"batch {b}"] = best
            print(f"batch {b}: " + ", ".join(f"{k} {v:.3f}" for k, v in best.items()), flush=True)
            if args.cprofile:
                _cprofile(engine, b, args, args.cprofile)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0


def _cprofile(engine: Any, batch: int, args: argparse.Namespace, top: int) -> None:
    import cProfile
    import io
    import pstats

    from hwkv.bench.e2e_report import profile

    pr = cProfile.Profile()
    pr.enable()
    profile(engine, VOCAB, batch, args.steps, args.prompt_len, gpu=False)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(f"--- cProfile, batch {batch} (prefill + {args.steps} decode steps), by own time ---")
    print(s.getvalue())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="hwkv bench host")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))

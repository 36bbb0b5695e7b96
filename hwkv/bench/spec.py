"""`hwkv bench spec`: speculative-decoding decode speedup vs non-speculative decoding.

Scenarios (greedy, ``ignore_eos``), each at every batch size of ``--batch-sizes``:

* ``ngram``: prompts that repeat a motif (code-like repetition), n-gram prompt lookup;
* ``self``: a draft model that *is* the target: every draft the target agrees with is accepted (the
  mechanism's ceiling: acceptance ~1, speedup limited by the verify and draft costs);
* ``layer1``: a 1-layer draft of the target's shape. With random weights its acceptance is
  meaningless (the two models' distributions are unrelated): it measures the cost side only;
* ``eagle`` (not in the default set): a random-weight EAGLE-1 head of the target's shape — the cost
  side of EAGLE (graphs returning the target's states, the head's catch-up and graphed draft steps);
  its acceptance is meaningless too.

Decode throughput counts the tokens after the first one over the time from the first token to the
last (prefill excluded); *verify-only* takes the proposer's time out (drafts for free: the ceiling of
the verify mechanism, the number that matters for ``self``, whose draft costs as much as the
target). The baseline is measured twice: with the engine's defaults (graphs where the backend
captures them, async scheduling) and eager (``enforce_eager``: no graphs). ``verify_graph_steps``
counts the speculative run's verify steps that replayed captured graphs (pure-verify steps).
Random-weight models of realistic shape are written where the bench runs (no downloads).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench import results_dir
from hwkv.bench.common import SHAPES as MODEL_SHAPES
from hwkv.bench.common import backend

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": MODEL_SHAPES["llama-1b"],
    "tiny": dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                 max_position_embeddings=2048),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b", help=f"a local HF dir or a shape: {', '.join(SHAPES)}")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--scenarios", default="ngram,self,layer1", help="any of ngram, self, layer1, eagle")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens generated per request")
    p.add_argument("--engine-args", default="{}", help="JSON of extra Engine keyword arguments")
    p.add_argument("--out-dir", default=None, help="where JSON + Markdown go (default: hwkv.bench.results_dir())")
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--host", action="store_true",
                   help="instead: the host path per step on the CPU with a stub model (hwkv.bench.spec_host)")
    p.add_argument("--repeat", type=int, default=3, help="--host: runs per row, the fastest kept")


def _write_model(args: argparse.Namespace, name: str, **over: Any) -> Path:
    import torch

    from hwkv.model.tiny import write_tiny_model

    d = Path(args.workdir) / f"{name}-{args.dtype}"
    if not (d / "config.json").exists():
        write_tiny_model(d, dtype=getattr(torch, args.dtype), tokenizer=False, **{**SHAPES[args.model], **over})
    return d


def _write_eagle(args: argparse.Namespace, target: Path) -> str:
    """A random-weight EAGLE-1 head of the target's shape (its embedding and LM head are the target's)."""
    import torch

    from hwkv.spec_decode.tiny_heads import write_eagle_head

    c = json.loads((target / "config.json").read_text())
    d = Path(args.workdir) / f"{target.name}-eagle-{args.dtype}"
    if not (d / "config.json").exists():
        write_eagle_head(d, c["hidden_size"], c["num_attention_heads"], c.get("num_key_value_heads"),
                         c.get("intermediate_size"), c["vocab_size"], seed=2, dtype=getattr(torch, args.dtype),
                         rope_theta=c.get("rope_theta", 10000.0),
                         max_position_embeddings=c.get("max_position_embeddings", 4096))
    return str(d)


def _prompts(kind: str, n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "ngram":  # a motif of 8..32 tokens repeated, like code or a quoted document
            motif = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(8, 32))]
            out.append((motif * (length // len(motif) + 1))[:length])
        else:
            out.append([rng.randrange(100, vocab - 100) for _ in range(length)])
    return out


def _decode(engine: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    from hwkv.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.generate([p[:16] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                    use_tqdm=False)  # warm-up (allocator, kernels)
    engine.backend.device.synchronize()
    marks: list[tuple[float, float]] = []  # per engine step: (its end, proposer seconds so far)
    step = engine._step

    def timed_step(stream: bool) -> Any:
        out = step(stream)
        marks.append((time.monotonic(), getattr(engine.runner, "propose_s", 0.0)))
        return out

    engine._step = timed_step
    t0 = time.perf_counter()
    try:
        outs = engine.generate(prompts, params, use_tqdm=False)
    finally:
        del engine._step
    wall = time.perf_counter() - t0
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finish_time for o in outs)
    n = sum(len(o.token_ids) - 1 for o in outs)
    res = {"decode_tok_s": n / max(last - first, 1e-9), "wall_s": wall, "tokens": [list(o.token_ids) for o in outs]}
    # The window [first, last] holds the steps after the one that produced the first token (that one
    # proposed before it): the proposer's time in the window is what they spent.
    after = [p for t, p in marks if t >= first]
    prop = after[-1] - after[0]
    steps = max(len(after) - 1, 1)
    # the verify side alone: as if drafts were free (the ceiling a cheap proposer approaches)
    res["verify_only_tok_s"] = n / max(last - first - prop, 1e-9)
    res["step_ms"] = (last - first) / steps * 1e3
    res["step_ms_excl_propose"] = (last - first - prop) / steps * 1e3
    res.update(_graph_ms(engine, len(prompts), max(len(p) for p in prompts) + tokens))
    st = engine.stats().get("spec_decode")
    if st is not None:
        res["spec"] = {k: st[k] for k in ("acceptance_rate", "mean_accepted_length", "acceptance_rate_per_position",
                                          "draft_tokens", "accepted_tokens", "verify_graph_steps")}
    return res


def _graph_ms(engine: Any, batch: int, max_seq_len: int, reps: int = 20) -> dict[str, float | None]:
    """Device ms of one replay of the decode graph and of the verify graph serving ``batch`` requests up
    to ``max_seq_len`` (``None`` where none was captured): a step's wall time less this is host time."""
    r, dev = engine.runner, engine.backend.device
    out: dict[str, float | None] = {}
    for name, runner in (("decode_graph_ms", r.graphs), ("verify_graph_ms", getattr(r, "verify_graphs", None))):
        g = runner.graph(batch, max_seq_len) if runner is not None else None
        if g is None:
            out[name] = None
            continue
        start, end = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
        g.replay()  # inputs as the last step left them; its KV rewrites go to freed blocks
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        end.synchronize()
        out[name] = start.elapsed_time(end) / reps
    return out


def _engine(mdir: Path, args: argparse.Namespace, batch: int, **kw: Any) -> Any:
    opts = {"max_model_len": args.prompt_len + args.tokens + 64, "max_num_seqs": max(batch, 2),
            **json.loads(args.engine_args), **kw}
    return hwkv.Engine(str(mdir), backend=backend(args.backend), dtype=args.dtype, **opts)


def _free(engine: Any) -> None:
    dev = engine.backend.device
    for holder in (engine.runner, getattr(engine.runner, "proposer", None)):  # the graphs hold device memory
        for name in ("graphs", "verify_graphs", "catchup_graphs"):
            if getattr(holder, name, None) is not None:
                getattr(holder, name).graphs.clear()
    del engine
    gc.collect()
    dev.empty_cache()


def run(args: argparse.Namespace) -> int:
    if args.host:
        from hwkv.bench import spec_host

        return spec_host.run(args)
    target = _write_model(args, args.model) if args.model in SHAPES else Path(args.model)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    k = args.num_speculative_tokens
    scen = [s for s in args.scenarios.split(",") if s]
    bad = sorted(set(scen) - {"ngram", "self", "layer1", "eagle"})
    if bad:
        print(f"hwkv bench spec: unknown scenarios {bad} (allowed: ngram, self, layer1, eagle)", file=sys.stderr)
        return 2
    if "layer1" in scen and args.model not in SHAPES:
        print("hwkv bench spec: scenario layer1 needs --model to be a shape (it writes a 1-layer draft of it)",
              file=sys.stderr)
        return 2
    configs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 8},
        "self": {"method": "draft_model", "num_speculative_tokens": k, "model": str(target)},
    }
    if "layer1" in scen:
        configs["layer1"] = {"method": "draft_model", "num_speculative_tokens": k,
                             "model": str(_write_model(args, f"{args.model}-1layer", num_layers=1, seed=1))}
    if "eagle" in scen:
        configs["eagle"] = {"method": "eagle", "num_speculative_tokens": k, "model": _write_eagle(args, target)}
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for kind in sorted({"ngram" if s == "ngram" else "random" for s in scen}):
            prompts = _prompts(kind, batch, args.prompt_len, vocab)
            base = {}
            for label, kw in (("default", {}), ("eager", {"enforce_eager": True})):
                eng = _engine(target, args, batch, **kw)
                base[label] = _decode(eng, prompts, args.tokens)
                _free(eng)
            for s in scen:
                if ("ngram" if s == "ngram" else "random") != kind:
                    continue
                eng = _engine(target, args, batch, speculative_config=configs[s])
                r = _decode(eng, prompts, args.tokens)
                _free(eng)
                row = {"scenario": s, "batch": batch, "k": k,
                       "baseline_tok_s": base["default"]["decode_tok_s"], "eager_tok_s": base["eager"]["decode_tok_s"],
                       "spec_tok_s": r["decode_tok_s"],
                       "speedup": r["decode_tok_s"] / base["default"]["decode_tok_s"],
                       "speedup_vs_eager": r["decode_tok_s"] / base["eager"]["decode_tok_s"],
                       "verify_only_tok_s": r["verify_only_tok_s"],
                       "verify_only_speedup": r["verify_only_tok_s"] / base["default"]["decode_tok_s"],
                       "identical_to_baseline": r["tokens"] == base["eager"]["tokens"], **r["spec"],
                       "baseline_step_ms": base["default"]["step_ms"], "step_ms": r["step_ms"],
                       "step_ms_excl_propose": r["step_ms_excl_propose"],
                       "decode_graph_ms": base["default"]["decode_graph_ms"], "verify_graph_ms": r["verify_graph_ms"]}
                rows.append(row)
                print(json.dumps({x: v for x, v in row.items() if x != "acceptance_rate_per_position"}), flush=True)
    out_dir = Path(args.out_dir) if args.out_dir else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    import platform

    dev = backend(args.backend).device
    meta = {"model": args.model, "backend": args.backend, "device": getattr(dev, "name", str(dev)),
            "dtype": args.dtype, "k": k, "prompt_len": args.prompt_len, "tokens": args.tokens,
            "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "argv": sys.argv}
    stem = f"spec-{args.backend}-{args.model.replace('/', '_')}-{meta['date']}{('-' + args.tag) if args.tag else ''}"
    (out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out_dir / f"{stem}.md").write_text(_markdown(meta, rows))
    print(f"wrote {out_dir / stem}.json and .md")
    return 0


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# hwkv bench spec — {meta['model']} on {meta['backend']} ({meta['device']}), {meta['dtype']}, "
             f"k={meta['k']}, prompt {meta['prompt_len']}, {meta['tokens']} tokens/request", "",
             "| scenario | batch | baseline tok/s | eager tok/s | spec tok/s | speedup | vs eager | "
             "verify-only speedup | acceptance | tokens/verify | graph verify steps | identical | "
             "step ms: baseline / spec / spec excl. proposer | graph replay ms: decode / verify |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['batch']} | {r['baseline_tok_s']:.1f} | {r['eager_tok_s']:.1f} | "
                     f"{r['spec_tok_s']:.1f} | {r['speedup']:.2f}x | {r['speedup_vs_eager']:.2f}x | "
                     f"{r['verify_only_speedup']:.2f}x | "
                     f"{r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} | {r['verify_graph_steps']} | "
                     f"{r['identical_to_baseline']} | {r['baseline_step_ms']:.3f} / {r['step_ms']:.3f} / "
                     f"{r['step_ms_excl_propose']:.3f} | {_ms(r['decode_graph_ms'])} / {_ms(r['verify_graph_ms'])} |")
    lines += ["", "speedup: vs the default engine (graphs where captured, async scheduling); vs eager: vs "
              "enforce_eager (no graphs); verify-only: the speculative run's throughput with the "
              "proposer's time taken out (drafts for free: the ceiling a cheap proposer approaches — with "
              "draft = target the draft costs as much as the target, so only this column can exceed 1 much).",
              "", "Random weights: acceptance of the 1-layer draft (and of n-gram beyond the repetition the "
              "target happens to produce) says nothing about real models; `self` (draft = target, acceptance "
              "~1) shows the mechanism's ceiling.", "",
              "step ms: wall time per engine step after the first token (the baseline's are pipelined with async "
              "scheduling); graph replay ms: device time of one replay of the decode / verify graph at this batch "
              "(a step's time less its replay is what the host adds where nothing overlaps it).", ""]
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"

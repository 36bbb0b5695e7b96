"""`hwkv bench structured`: the throughput cost of structured outputs — json_schema vs free generation
of the same batch, same engine, same run.

Each request generates ``--output-len`` tokens (``ignore_eos`` for the free run). Schemas:

* ``string``: ``{"text": <string>}`` — a random-weight model stays inside the string (almost every
  token is allowed there), so each answer runs to ``--output-len``: the cost per token of the mask;
* ``records``: an array of at least 40 objects of enums, bounded integers, booleans, numbers and
  short strings — the matcher moves through many grammar states, and no answer can end before
  ``--output-len`` (every run keeps the whole batch).

Throughput = generated tokens / wall time of ``Engine.generate`` over the whole batch (prefill
included), the best of ``--repeat`` runs, the free and constrained runs interleaved. ``mask_ms``: the
main thread's mask time per step, on the step's critical path (waiting for the grammar worker
included); ``worker_ms``: the worker thread's time per step advancing matchers and filling the next
step's masks, overlapped with the step's other host work and the device's forward
(:meth:`hwkv.engine.structured.StructuredOutputs.prefetch`); ``NAME+inline`` turns the worker off.

A random-weight shape (``--model llama-1b``) has no tokenizer: the bench writes a synthetic byte-level
BPE of the model's vocabulary size (256 bytes + deterministic merges up to 10 characters), so the
grammar engine sees a vocabulary of realistic size and token lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from hwkv.bench import results_dir
from hwkv.bench.common import SHAPES, TINY, backend, write_result
from hwkv.bench.common import model_dir as common_model_dir

SCHEMAS: dict[str, dict[str, Any]] = {
    "string": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
               "additionalProperties": False},
    "records": {"type": "array", "minItems": 40, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "kind", "ok", "name", "score"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "kind": {"enum": ["alpha", "beta", "gamma", "delta"]}, "ok": {"type": "boolean"},
                       "name": {"type": "string", "maxLength": 12},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}}}},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b", help="a local HF dir, or a shape: llama-1b, qwen-0.5b, tiny")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--schemas", default="string,records",
                   help="comma list of string, records; NAME+pageable: that schema with the mask in pageable "
                        "host memory (an A/B of the pinned double buffer); NAME+inline: every mask computed in "
                        "the step, no worker thread (an A/B of the overlap); NAME+gil: a short GIL switch "
                        "interval; NAME+tN: llguidance's executor with N threads; NAME+shared: each request's "
                        "matcher a deep copy of the cached one (sharing its lexer and lock; the A/B of matchers "
                        "of their own)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--unseeded", action="store_true",
                   help="requests without a seed (every run): one draw from the shared generator per step instead "
                        "of two launches of each request's own")
    p.add_argument("--gil-switch-ms", type=float, default=0.2,
                   help="NAME+gil in --schemas: that schema with the GIL switch interval at this many ms while "
                        "constrained requests run (StructuredOutputs.switch_s; NAME+nogil: Python's interval)")
    p.add_argument("--prompts", choices=("random", "chat"), default="random",
                   help="random token ids, or the real-model tier's chat prompts asking for a JSON answer "
                        "(a model with a chat template, e.g. the SmolLM2 GGUF)")
    p.add_argument("--mask-threads", type=int, default=None, help="llguidance executor threads (default: the "
                   "engine's, hwkv.engine.structured.MASK_THREADS)")
    p.add_argument("--mask-only", type=int, default=0, metavar="STEPS",
                   help="no engine: time llguidance alone for --batch matchers over STEPS steps of random allowed "
                        "tokens (the synthetic tokenizer of --model's vocabulary): matchers of their own (the "
                        "engine's) vs deep copies of one (sharing its lexer), one thread and llguidance's executor "
                        "on each of --thread-counts")
    p.add_argument("--thread-counts", default="2,4,8,16,0",
                   help="--mask-only: executor thread counts to time (0: llguidance's default, 80%% of the cores)")
    p.add_argument("--engine-args", default="{}", help="JSON of extra Engine keyword arguments")
    p.add_argument("--out-dir", default=None)


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` ids: ids 0/1/2 are
    ``<s>``/``</s>``/``<pad>``, then the 256 byte symbols, then merges of existing tokens (biased to
    letters and a leading space, up to 10 characters), deterministic for ``seed``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    alphabet.sort()
    vocab: dict[str, int] = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    common = [c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789Ġ,.:\"{}[]_-" if c in vocab]
    rng = random.Random(seed)
    tokens = list(common)
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        a = rng.choice(tokens) if rng.random() < 0.7 else rng.choice(common)
        b = rng.choice(common) if rng.random() < 0.8 else rng.choice(tokens)
        t = a + b
        if len(t) > 10 or t in vocab:
            continue
        vocab[t] = len(vocab)
        merges.append((a, b))
        tokens.append(t)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
    return tok


def model_dir(args: argparse.Namespace) -> Path:
    shapes = {**SHAPES, "tiny": TINY}
    if args.model not in shapes:
        src = Path(args.model)
        if not src.is_dir() or (src / "tokenizer.json").exists() or not (src / "config.json").exists():
            return src
        # a random-weight checkpoint without a tokenizer (bench/real_model_gpu.py --shape): a copy of
        # links beside it, with the synthetic tokenizer of its vocabulary size
        d = Path(args.workdir) / f"{src.name}-tok"
        if not (d / "tokenizer.json").exists():
            d.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                if not (d / f.name).exists():
                    (d / f.name).symlink_to(f.resolve())
            vocab = json.loads((src / "config.json").read_text())["vocab_size"]
            synthetic_tokenizer(vocab).save(str(d / "tokenizer.json"))
            (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}) + "\n")
        return d
    d = Path(args.workdir) / f"{args.model}-{args.dtype}-tok"
    if not (d / "tokenizer.json").exists():
        # the other benches' random-weight copy (no tokenizer; drawn on the GPU where there is one), linked
        base = common_model_dir(args)
        d.mkdir(parents=True, exist_ok=True)
        for f in base.iterdir():
            if not (d / f.name).exists():
                (d / f.name).symlink_to(f.resolve())
        synthetic_tokenizer(shapes[args.model]["vocab_size"]).save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}) + "\n")
    return d


def mask_only(args: argparse.Namespace) -> int:
    """Host cost of the masks alone: ``--batch`` matchers per schema advance by a random allowed token
    per step (as a random-weight model samples), same tokens in every configuration: matchers of their
    own (each compiled: the engine's) vs deep copies of one compiled matcher (llguidance shares the
    lexer and its lock between copies), filled by one thread (each row also timed alone: the per-row
    tail) and by llguidance's executor with each of ``--thread-counts`` threads."""
    import llguidance
    import numpy as np
    import torch

    from hwkv.engine.structured import MASK_THREADS, grammar_of

    shapes = {**SHAPES, "tiny": TINY}
    if args.model in shapes:
        vocab = shapes[args.model]["vocab_size"]
    else:  # a checkpoint dir: its vocabulary size (the tokenizer is the synthetic one all the same)
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    tok = synthetic_tokenizer(vocab)
    llt = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=1)
    words = (vocab + 31) // 32
    counts = [int(x) for x in args.thread_counts.split(",") if x.strip()]
    res: dict[str, Any] = {}
    for name in [s for s in args.schemas.split(",") if s]:
        grammar = grammar_of({"json": SCHEMAS[name]})
        for kind in ("own", "copies"):
            for threads in [1, *counts]:
                if kind == "own":
                    ms = [llguidance.LLMatcher(llt, grammar, log_level=0) for _ in range(args.batch)]
                else:
                    base = llguidance.LLMatcher(llt, grammar, log_level=0)
                    ms = [base.deep_copy() for _ in range(args.batch)]
                ex = None if threads == 1 else llguidance.LLExecutor(num_threads=threads or None)
                mask = torch.full((args.batch, words), -1, dtype=torch.int32)
                # a warm-up walk (other tokens), then the timed one from the start: the engine reuses a
                # request's matcher, reset, for the next one, so its lexer's caches are warm
                _walk(ms, ex, mask, words, vocab, args.mask_only, random.Random(1))
                for m in ms:
                    m.reset()
                rng = random.Random(0)
                times, rows, slowest = [], [], []  # one thread: each row timed alone too
                for _ in range(args.mask_only):
                    live = [(m, i) for i, m in enumerate(ms) if not m.is_stopped()]
                    if not live:
                        break
                    t = time.perf_counter()
                    if ex is not None:
                        ex.unsafe_compute_mask_ptr(live, mask.data_ptr(), words * 4, args.batch)
                    else:
                        ts = []
                        for m, i in live:
                            t1 = time.perf_counter()
                            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
                            ts.append(time.perf_counter() - t1)
                        rows += ts
                        slowest.append(max(ts))
                    times.append(time.perf_counter() - t)
                    bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
                    for m, i in live:
                        allowed = np.flatnonzero(bits[i])
                        m.consume_token(int(allowed[rng.randrange(len(allowed))]))
                q = sorted(times)
                label = "1 thread" if threads == 1 else f"executor {threads or 'default (80% of cores)'} threads"
                key = f"{name}/{kind}/{label}"
                res[key] = {"steps": len(q), "mean_ms": 1e3 * sum(q) / len(q), "p50_ms": 1e3 * q[len(q) // 2],
                            "p90_ms": 1e3 * q[int(len(q) * 0.9)], "max_ms": 1e3 * q[-1]}
                if rows:  # a parallel fill ends with its slowest row: the mean of those is its floor
                    r = sorted(rows)
                    res[key]["row_ms_p50_p90_p99_max"] = [round(1e3 * r[int(len(r) * f)], 4)
                                                          for f in (0.5, 0.9, 0.99)] + [round(1e3 * r[-1], 4)]
                    res[key]["slowest_row_mean_ms"] = 1e3 * sum(slowest) / len(slowest)
                    print(f"{key:>44}: per row p50/p90/p99/max {res[key]['row_ms_p50_p90_p99_max']} ms; the slowest "
                          f"row of a step {res[key]['slowest_row_mean_ms']:.3f} ms on average", flush=True)
                print(f"{key:>44}: {args.batch} rows, {len(q)} steps: mask mean {res[key]['mean_ms']:.3f} ms/step "
                      f"p50 {res[key]['p50_ms']:.3f} p90 {res[key]['p90_ms']:.3f} max {res[key]['max_ms']:.3f}",
                      flush=True)
    out = (Path(args.out_dir) if args.out_dir else results_dir()) / f"structured-mask-only-{Path(args.model).name}.json"
    write_result(out, {"bench": "structured --mask-only", "model": args.model, "vocab": vocab, "batch": args.batch,
                       "engine_mask_threads": MASK_THREADS, "cores": len(os.sched_getaffinity(0)),
                       "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": res})
    return 0


def _walk(ms: list[Any], ex: Any, mask: Any, words: int, vocab: int, steps: int, rng: random.Random) -> None:
    """``steps`` masks of every live matcher, each then consuming a random allowed token (warm-up)."""
    import numpy as np

    for _ in range(steps):
        live = [(m, i) for i, m in enumerate(ms) if not m.is_stopped()]
        if not live:
            return
        if ex is not None:
            ex.unsafe_compute_mask_ptr(live, mask.data_ptr(), words * 4, len(ms))
        else:
            for m, i in live:
                m.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
        bits = np.unpackbits(mask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for m, i in live:
            allowed = np.flatnonzero(bits[i])
            m.consume_token(int(allowed[rng.randrange(len(allowed))]))


def run(args: argparse.Namespace) -> int:
    import hwkv
    from hwkv.engine.structured import MASK_THREADS

    if args.mask_only:
        return mask_only(args)

    mdir = model_dir(args)
    print(f"model at {mdir} ({time.strftime('%T')})", flush=True)
    kw = {"backend": backend(args.backend), "max_num_seqs": max(args.batch, 1), **json.loads(args.engine_args)}
    engine = hwkv.Engine(mdir, **kw)
    vocab = engine.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.input_len)] for _ in range(args.batch)]
    if args.prompts == "chat":
        from hwkv.model.packaged import CHAT_PROMPTS

        tok = engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"{CHAT_PROMPTS[i % 8]} Answer "
                                                        "in JSON."}]), add_special_tokens=False)
                   for i in range(args.batch)]
    so = engine.runner.structured
    if args.mask_threads:
        import llguidance

        so._executor = llguidance.LLExecutor(num_threads=args.mask_threads)
    step_s: list[float] = []  # host time of each bitmask() call that masked something
    inner = so.bitmask

    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        m = inner(*a, **k)
        if m is not None:
            step_s.append(time.perf_counter() - t)
        return m
    so.bitmask = timed

    import torch

    pinned = so._buffer

    def pageable(rows: int, device: Any, fill: bool = True) -> torch.Tensor:  # the mask buffer before pinning (A/B)
        return torch.full((rows, so.words), -1, dtype=torch.int32)

    def one(schema: str | None, seed0: int) -> dict[str, Any]:
        base = schema.split("+")[0] if schema else None  # "records+pageable": that schema, mask buffer pageable
        sps = [hwkv.SamplingParams(temperature=1.0, seed=None if args.unseeded else seed0 + i,
                                   max_tokens=args.output_len, ignore_eos=schema is None,
                                   structured_outputs=None if base is None else {"json": SCHEMAS[base]})
               for i in range(args.batch)]
        c0 = (so.mask_s, so.num_masks, so.join_s, so.worker_s, so.rows_prefetched, so.rows_computed,
              so.wake_s, engine.runner.token_wait_s, so.rows_in_place)
        parts = ("gather_s", "compute_s", "copy_s", "consume_s", "fill_s")
        p0 = [getattr(so, k) for k in parts]
        step_s.clear()
        so._buffer = pageable if schema and "+pageable" in schema else pinned
        so.overlap = not (schema and "+inline" in schema)
        so.shared_lexer = bool(schema and "+shared" in schema)
        switch, executor, switch_s = sys.getswitchinterval(), so._executor, so.switch_s
        if schema and "+gil" in schema:  # the A/B of a short GIL switch interval while constrained requests run
            so.switch_s = args.gil_switch_ms / 1e3
        elif schema and "+nogil" in schema:  # the A/B of Python's interval (5 ms by default)
            so.switch_s = None
        threads = next((int(x[1:]) for x in (schema or "").split("+")[1:] if x[:1] == "t" and x[1:].isdigit()), 0)
        if threads:  # NAME+tN: llguidance's executor with N threads for this run
            import llguidance

            so._executor = llguidance.LLExecutor(num_threads=threads)
        t0 = time.perf_counter()
        try:
            outs = engine.generate(prompts, sps, use_tqdm=False)
        finally:
            sys.setswitchinterval(switch)
            so.switch_s = switch_s
            so._executor = executor
        dt = time.perf_counter() - t0
        so.join()  # the last step's prefetch (masks no step takes) counts here, not in the next run
        so._buffer, so.overlap, so.shared_lexer = pinned, True, False
        toks = sum(len(o.token_ids) for o in outs)
        n = max(so.num_masks - c0[1], 1)
        row = {"tokens": toks, "seconds": dt, "tok_s": toks / dt,
               # main thread: the mask's time on the step's critical path (the wait for the worker included)
               "mask_ms_per_step": 1e3 * (so.mask_s - c0[0]) / n,
               "join_ms_per_step": 1e3 * (so.join_s - c0[2]) / n,
               "worker_ms_per_step": 1e3 * (so.worker_s - c0[3]) / n,  # overlapped with the step's other work
               "rows_prefetched": so.rows_prefetched - c0[4], "rows_computed": so.rows_computed - c0[5],
               "steps": so.num_masks - c0[1],
               # worker: from a step's submit to its tokens read (the device's sampling + the GIL); main
               # thread: waiting for the previous step's tokens (per step of this run, free runs too)
               "worker_wake_ms_per_step": 1e3 * (so.wake_s - c0[6]) / n,
               "main_token_wait_ms_per_step": 1e3 * (engine.runner.token_wait_s - c0[7]) / max(args.output_len, 1),
               "matchers_built": so.num_matchers,
               "rows_in_place": so.rows_in_place - c0[8]}  # of rows_prefetched: no gather (see prefetch())
        # main thread after the join: gather of the worker's rows, rows computed in the step (their
        # consumes included), the copy's launch; worker: consume_token_par, mask fill
        row["parts_ms_per_step"] = {k[:-2]: round(1e3 * (getattr(so, k) - v) / n, 3) for k, v in zip(parts, p0)}
        if step_s:
            q = sorted(step_s)
            row["mask_ms_p50_p90_max"] = [round(1e3 * q[len(q) // 2], 3), round(1e3 * q[int(len(q) * 0.9)], 3),
                                          round(1e3 * q[-1], 3)]
        if schema is not None:
            texts = [engine.tokenizer.decode(o.token_ids) if engine.tokenizer else o.text for o in outs]
            done = [o for o, t in zip(outs, texts) if o.finish_reason == "stop"]
            row["finished"] = len(done)
            row["valid_json_of_finished"] = sum(_parses(o.text) for o in done)
        return row

    def show(name: str, row: dict[str, Any]) -> None:
        print(f"{name:>8}: {row['tokens']} tokens in {row['seconds']:.3f} s = {row['tok_s']:,.0f} tok/s"
              f"  mask {row['mask_ms_per_step']:.3f} ms/step (p50/p90/max {row.get('mask_ms_p50_p90_max')}; "
              f"join {row['join_ms_per_step']:.3f}, worker {row['worker_ms_per_step']:.3f} ms/step, rows "
              f"prefetched/computed {row['rows_prefetched']}/{row['rows_computed']}; {row['parts_ms_per_step']}; "
              f"worker wake {row['worker_wake_ms_per_step']:.3f}, main token wait "
              f"{row['main_token_wait_ms_per_step']:.3f} ms/step)",
              flush=True)

    names = [s for s in args.schemas.split(",") if s]
    print(f"engine ready ({time.strftime('%T')}); warm-up (graphs, kernels, grammars compiled)", flush=True)
    for key in [None, *names]:
        show(f"{key or 'free'} (warm-up)", one(key, 0))
    best: dict[str, dict[str, Any]] = {}
    dev = engine.backend.device.description()
    out = (Path(args.out_dir) if args.out_dir else results_dir()) / \
        f"structured-{Path(args.model).stem}-{dev.split(' (')[0].replace(' ', '_')}.json"
    for r in range(args.repeat):
        for key in [None, *names]:
            row = one(key, 1000 * (r + 1))
            name = key or "free"
            if name not in best or row["tok_s"] > best[name]["tok_s"]:
                best[name] = row
            show(name, row)
        free = best["free"]["tok_s"]
        for s in names:
            best[s]["cost_vs_free"] = 1 - best[s]["tok_s"] / free
        doc = {"bench": "structured", "model": args.model, "backend": args.backend, "device": dev,
               "prompts": args.prompts, "seeded": not args.unseeded, "mask_threads": args.mask_threads or MASK_THREADS,
               "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
               "engine": {k: v for k, v in kw.items() if k != "backend"}, "grammar_engine": "llguidance",
               "repeats_done": r + 1, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "results": best}
        write_result(out, doc)  # after every round: a run cut short keeps what it measured
    for s in names:
        print(f"{s}: {best[s]['tok_s']:,.0f} tok/s vs free {free:,.0f} -> cost {100 * best[s]['cost_vs_free']:.1f}%")
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False

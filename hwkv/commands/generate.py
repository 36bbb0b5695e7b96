"""`hwkv generate`: generate from a local HF model directory; `--demo` builds a tiny model itself.

The demo model is cached in ``$XDG_CACHE_HOME/hwkv/demo-llama`` (``~/.cache/hwkv/demo-llama``;
``--demo-dir D`` puts it in ``D/hwkv/demo-llama``). It is written to a temporary directory next to
it and renamed into place with a completion marker, so an interrupted first run leaves nothing a
later run would load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hwkv

DEMO_PROMPTS = [
    "Hello, world! How are you",
    "The quick brown fox",
    "Once upon a time there was a little engine that",
    "What is the capital of France?",
]
DEMO_SYSTEM = "You are a helpful assistant. Answer briefly and politely, in plain English. "
DEMO_MODEL = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                  max_position_embeddings=1024, seed=0)
_DEMO_MARKER = "hwkv-demo.json"  # written last: a directory without it is incomplete


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face model directory (config.json, safetensors, tokenizer.json) "
                   "or GGUF file")
    p.add_argument("--demo", action="store_true",
                   help="write a tiny random-weight model locally (no download) and generate from a few prompts")
    p.add_argument("--demo-dir", default=None,
                   help="cache root for --demo's model: DIR/hwkv/demo-llama (default: $XDG_CACHE_HOME or ~/.cache)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: $OMP_NUM_THREADS, else 1 for --demo and a few for --model)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 | auto (default: the checkpoint's)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None, help="running requests (default: by device, "
                   "docs/engine.md)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: by device, docs/engine.md; >= max_model_len without chunking)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 (float8 e4m3 KV: half the bytes)")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--json", action="store_true", help="print outputs and stats as JSON")


def demo_model_dir(demo_dir: str | None = None) -> Path:
    base = demo_dir or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hwkv" / "demo-llama"


def _is_complete(root: Path) -> bool:
    try:
        return json.loads((root / _DEMO_MARKER).read_text()) == DEMO_MODEL
    except (OSError, ValueError):
        return False


def _demo_model(args: argparse.Namespace) -> str:
    """The demo model's directory, written atomically on first use (module docstring)."""
    from hwkv.model.tiny import write_tiny_model

    root = demo_model_dir(args.demo_dir)
    if _is_complete(root):
        return str(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".demo-llama-", dir=root.parent))
    except OSError:  # read-only home: build in a temporary directory for this run only
        tmp = Path(tempfile.mkdtemp(prefix="hwkv-demo-"))
        write_tiny_model(tmp / "demo-llama", **DEMO_MODEL)
        return str(tmp / "demo-llama")
    try:
        write_tiny_model(tmp, **DEMO_MODEL)
        (tmp / _DEMO_MARKER).write_text(json.dumps(DEMO_MODEL))
        if root.exists():  # incomplete (an interrupted run of an older hwkv) or another model: replace
            stale = Path(tempfile.mkdtemp(prefix=".demo-llama-stale-", dir=root.parent))
            os.replace(root, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        os.replace(tmp, root)
    except OSError:
        if not _is_complete(root):  # else a concurrent run finished first: use its copy
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(root)


def set_threads(args: argparse.Namespace) -> int:
    """Torch CPU threads: ``--threads``, else ``$OMP_NUM_THREADS``, else 1 for the demo (its
    matrices are tiny: more threads only contend — ~40x slower on a loaded 2-core machine) and
    ``min(4, usable cores)`` for a real model. Returns the number set."""
    import torch

    n = args.threads
    if n is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        n = int(os.environ["OMP_NUM_THREADS"])
    if n is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = 1 if args.demo and not args.model else min(4, cores)
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        backend=args.backend, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill, kv_cache_dtype=args.kv_cache_dtype,
    )


def _chat_ids(engine: Any, text: str) -> list[int]:
    """``text`` as a user message rendered by the chat template; the template writes the special
    tokens it wants (BOS included), so none are added on encoding (as the server's chat route)."""
    tok = engine.tokenizer
    if tok is None or not tok.chat_template:
        raise ValueError("--chat needs a model with a chat template (tokenizer_config.json or GGUF metadata)")
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _print_outputs(title: str, outs: list[Any], secs: float, texts: list[str]) -> None:
    n = sum(len(o.token_ids) for o in outs)
    print(f"\n== {title}: {len(outs)} requests, {n} output tokens in {secs:.2f} s = {n / secs:.1f} tok/s")
    for o, text in zip(outs, texts):
        print(f"[{o.request_id}] {text!r}")
        m = o.metrics
        ttft = f"{1e3 * m.ttft:.1f} ms" if m.ttft is not None else "-"
        print(f"    -> {o.text!r}")
        print(f"       {len(o.token_ids)} tokens, finish={o.finish_reason}, ttft={ttft}, "
              f"cached prompt tokens={m.num_cached_tokens}")


def _print_stats(st: dict[str, Any]) -> None:
    print("\n== engine stats")
    for k, v in st.items():
        print(f"  {k:<26} {v:.4g}" if isinstance(v, float) else f"  {k:<26} {v}")


def run(args: argparse.Namespace) -> int:
    from hwkv.interfaces.backend import BackendUnavailable

    if not args.model and not args.demo:
        print("hwkv generate: error: give --model DIR or --demo", file=sys.stderr)
        return 2
    prompts = args.prompt or (DEMO_PROMPTS if args.demo else None)
    if not prompts:  # before loading anything
        print("hwkv generate: error: give at least one --prompt", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"hwkv generate: error: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    set_threads(args)
    try:
        model = args.model or _demo_model(args)
        kw = _engine_kwargs(args)
        if args.demo and args.num_kv_blocks is None:
            kw["num_kv_blocks"] = 256  # a small, fixed pool: the demo never sizes by host memory
        t0 = time.perf_counter()
        engine = hwkv.Engine(model, **kw)
        load_s = time.perf_counter() - t0
        params = hwkv.SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos or args.demo, stop=args.stop,
        )
        rounds = [("generate", prompts)]
        if args.demo and not args.prompt:
            # A second round sharing a long system prompt shows the prefix cache at work.
            rounds.append(("shared system prompt (prefix cache)", [DEMO_SYSTEM + p for p in prompts]))
            rounds.append(("same again", [DEMO_SYSTEM + p for p in prompts]))
        results = []
        for title, batch in rounds:
            inputs = [_chat_ids(engine, p) for p in batch] if args.chat else batch
            t0 = time.perf_counter()
            outs = engine.generate(inputs, params, use_tqdm=not args.json)
            results.append((title, outs, time.perf_counter() - t0, batch))
    except (ValueError, BackendUnavailable) as e:
        print(f"hwkv generate: error: {e}", file=sys.stderr)
        return 2
    stats = engine.stats()
    if args.json:
        json.dump({
            "model": model, "backend": args.backend,
            "outputs": [{"round": t, "request_id": o.request_id, "prompt": text, "text": o.text,
                         "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                        for t, outs, _, texts in results for o, text in zip(outs, texts)],
            "stats": stats,
        }, sys.stdout, indent=2)
        print()
        return 0
    print(f"model {model} on backend {args.backend!r} ({engine.backend.device.description()}), "
          f"loaded in {load_s:.2f} s; {engine.kv_cache.spec.num_blocks} KV blocks x {engine.block_size} tokens, "
          f"max_model_len {engine.max_model_len}")
    if args.demo:
        print("(random weights: the text is noise — the point is the pipeline: batching, prefix cache, stats)")
    for title, outs, secs, texts in results:
        _print_outputs(title, outs, secs, texts)
    _print_stats(stats)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hwkv generate")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""What the connector benches of hybrid models share (:mod:`hwkv_cuda.bench.hybrid_pool`,
:mod:`hwkv_cuda.bench.hybrid_pd`): their common arguments, the engines they start, the pools-whole check,
and the run itself - a random-weight checkpoint of a :mod:`hwkv_cuda.bench.hybrid_parity` shape (saved in
bf16), prompts longer than its window, a plain engine's greedy tokens (no connector) scored by HF's float32
forward under the conformance margin rule, then each case of the bench against them, written as it ends.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

Case = Callable[[str, str, list[list[int]], list[list[int]], Any, argparse.Namespace, int], dict[str, Any]]


def add_args(ap: argparse.ArgumentParser, workdir: str) -> None:
    """The arguments every hybrid connector bench takes (each adds its own cases' list)."""
    ap.add_argument("--shape", default="gemma3-1b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", default=workdir)
    ap.add_argument("--out", default=None)


def engine(path: str, a: argparse.Namespace, max_len: int, **kw: Any) -> Any:
    """An eager engine of the bench's checkpoint (four sequences, ``a.num_kv_blocks`` blocks); ``kw`` to the engine."""
    import hwkv

    return hwkv.Engine(path, backend=a.backend, dtype=a.dtype, max_model_len=max_len, max_num_seqs=4,
                       num_kv_blocks=a.num_kv_blocks, enforce_eager=True, **kw)


def pools_whole(*engines: Any) -> bool:
    """Every block of every group's pool free in each engine (nothing held, nothing leaked)."""
    return all(m.block_pool.num_free_blocks == m.block_pool.num_usable_blocks
               for e in engines for m in getattr(e.kv_cache_manager, "managers", [e.kv_cache_manager]))


def device_of(a: argparse.Namespace) -> str:
    return "cuda" if a.backend == "cuda" else "cpu"


def run(a: argparse.Namespace, bench: str, key: str, cases: list[str], case: Case) -> int:
    """Build the shape, run the plain engine, then ``case(path, name, prompts, plain_tokens, hf, a, max_len)``
    for each name of ``cases``: its record (with ``ok``) goes under ``doc[key]``, written to ``a.out`` as each
    ends; an exception is that case's record (``error``). Exit status 0 when every case is ``ok``."""
    import torch

    from hwkv.sampling_params import SamplingParams
    from hwkv_cuda.bench.hybrid_parity import build, prompts, score

    dev = device_of(a)
    doc: dict[str, Any] = {"bench": bench, "device": torch.cuda.get_device_name(0) if dev == "cuda" else dev,
                           "torch": torch.__version__, "args": vars(a), key: []}

    def save() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")

    t0 = time.perf_counter()
    path = Path(a.workdir) / a.shape
    hf = build(a.shape, path, dev)
    doc["build_s"] = round(time.perf_counter() - t0, 1)
    window = hf.config.sliding_window
    ps = prompts(a.prompts, max(window + 24, a.prompt_len), hf.config.vocab_size)
    doc["prompt_lens"], doc["window"] = [len(q) for q in ps], window
    max_len = min(1 << (max(len(q) for q in ps) + a.tokens - 1).bit_length(), hf.config.max_position_embeddings)
    print(f"[{a.shape}] built in {doc['build_s']} s; prompts {doc['prompt_lens']}", flush=True)
    e = engine(str(path), a, max_len)
    try:
        plain = [list(o.token_ids) for o in e.generate(
            ps, SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True), use_tqdm=False)]
    finally:
        e.close()
    doc["plain_margin_rule"] = score(hf, ps, plain, dev)
    print(f"[plain] margin rule {doc['plain_margin_rule']}", flush=True)
    save()
    ok = True
    for name in cases:
        try:
            r = case(str(path), name, ps, plain, hf, a, max_len)
        except Exception:
            r = {key[:-1]: name, "error": traceback.format_exc(), "ok": False}
        ok &= r["ok"]
        print(json.dumps(r), flush=True)
        doc[key].append(r)
        save()
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
    return 0 if ok else 1

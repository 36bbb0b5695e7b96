"""`hwkv bench e2e`: our engine vs HF transformers `generate`, side by side in one run.

(a) offline throughput: N requests, input/output lengths uniform in [lo, hi], ignore_eos;
(b) batch-1 decode: tokens/s and model-bandwidth utilisation (bytes read per step / step time /
    device-to-device copy bandwidth measured in the same run);
(c) shared prefix: requests sharing a long system prompt, prefix caching on vs off (TTFT, tok/s).

Random-weight models of realistic shape are written where the bench runs (no downloads) and loaded
through the normal loader path.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 q / 8 kv heads, head 64, ffn 8192, vocab 128256, tied.
    "llama-1b": dict(arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072),
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 q / 2 kv heads, head 64, ffn 4864, vocab 151936, tied.
    "qwen-0.5b": dict(arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                      rope_theta=1000000.0, max_position_embeddings=32768),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b", help=f"a local HF dir or a shape: {', '.join(SHAPES)}")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--hf-requests", type=int, default=64, help="requests HF generate runs (time-bounded)")
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--parts", default="a,b,c", help="comma list of a (throughput), b (batch-1), c (prefix)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--out", default=None, help="JSON output path (default bench/results/e2e-<device>-<date>.json)")
    p.add_argument("--engine-args", default="{}", help="JSON dict of extra Engine kwargs")


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model not in SHAPES:
        return Path(args.model)
    from hwkv.testing.tiny_models import write_tiny_model

    import torch

    d = Path(args.workdir) / f"{args.model}-{args.dtype}"
    if not (d / "config.json").exists():
        write_tiny_model(d, dtype=getattr(torch, args.dtype), seed=0, **SHAPES[args.model])
    return d


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def _workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(n)
    ]


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_engine(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from hwkv.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    _sync()
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params, use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return dict(seconds=dt, output_tokens=ntok, tok_per_s=ntok / dt, mean_ttft_s=sum(ttft) / len(ttft))


def run_hf(model_dir: Path, work: list[tuple[list[int], int]], batch: int, dtype: str) -> dict[str, float]:
    """HF `generate` at its best simple settings: bf16, SDPA, left padding, batches sorted by
    output length so padding waste is small; ignore_eos via min_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).to("cuda").eval()
    work = sorted(work, key=lambda w: w[1])
    warm = torch.randint(100, 1000, (1, 16), device="cuda")
    model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
    _sync()
    t0 = time.perf_counter()
    ntok = 0
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        L = max(len(p) for p, _ in chunk)
        ids = torch.zeros((len(chunk), L), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(chunk):
            ids[j, L - len(p) :] = torch.tensor(p)
            mask[j, L - len(p) :] = 1
        m = max(o for _, o in chunk)
        model.generate(
            ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=m, min_new_tokens=m,
            do_sample=False, pad_token_id=0,
        )
        ntok += sum(o for _, o in chunk)  # only the tokens each request asked for count
    _sync()
    dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    return dict(seconds=dt, output_tokens=ntok, tok_per_s=ntok / dt, batch=batch, requests=len(work))


def run(args: argparse.Namespace) -> int:
    import torch

    import hwkv

    extra = json.loads(args.engine_args)
    mdir = _model_dir(args)
    cfg = json.loads((mdir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    res: dict[str, Any] = dict(
        bench="e2e", model=args.model, dtype=args.dtype, backend=args.backend, device=dev,
        date=time.strftime("%Y-%m-%d"), command="hwkv bench e2e " + " ".join(sys.argv[3:]),
        torch=torch.__version__, hwkv=hwkv.__version__,
    )
    if torch.cuda.is_available():
        res["copy_bw_TBps"] = copy_bandwidth() / 1e12
    parts = set(args.parts.split(","))
    engine = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype, **extra)
    w_bytes = engine.model_runner.model.param_bytes() if hasattr(engine, "model_runner") else None

    if "a" in parts:
        work = _workload(args.num_requests, args.min_len, args.max_len, vocab)
        run_engine(engine, work[:8])  # warm-up (compilation, graph capture)
        res["throughput"] = dict(hwkv=run_engine(engine, work))
        if not args.no_hf:
            hf = run_hf(mdir, work[: args.hf_requests], args.hf_batch, args.dtype)
            res["throughput"]["hf"] = hf
            res["throughput"]["ratio"] = res["throughput"]["hwkv"]["tok_per_s"] / hf["tok_per_s"]
    if "b" in parts:
        prompt, n_out = _workload(1, 128, 128, vocab, seed=1)[0][0], 512
        r = run_engine(engine, [(prompt, n_out)])
        decode_s = r["seconds"] - r["mean_ttft_s"]
        step = decode_s / (n_out - 1)
        kv_tok = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * (
            cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) * 2
        avg_ctx = len(prompt) + n_out / 2
        bytes_step = (w_bytes or 0) + kv_tok * avg_ctx
        b = dict(tok_per_s=1 / step, step_ms=step * 1e3, weight_bytes=w_bytes, bytes_per_step=bytes_step)
        if "copy_bw_TBps" in res:
            b["mbu"] = bytes_step / step / (res["copy_bw_TBps"] * 1e12)
        if not args.no_hf:
            b["hf_tok_per_s"] = run_hf(mdir, [(prompt, 128)], 1, args.dtype)["tok_per_s"]
        res["batch1"] = b
    if "c" in parts:
        rng = random.Random(2)
        system = [rng.randrange(100, vocab - 100) for _ in range(2048)]
        work = [(system + [rng.randrange(100, vocab - 100) for _ in range(64)], 64) for _ in range(64)]
        c: dict[str, Any] = {}
        for on in (True, False):
            e = hwkv.Engine(str(mdir), backend=args.backend, dtype=args.dtype, enable_prefix_caching=on, **extra)
            run_engine(e, work[:2])
            c["prefix_on" if on else "prefix_off"] = run_engine(e, work)
            del e
        res["shared_prefix"] = c
    out = Path(args.out or f"bench/results/e2e-{dev.replace(' ', '_')}-{res['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="hwkv bench e2e")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))

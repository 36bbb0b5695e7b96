"""`hwkv bench e2e`: our engine vs HF transformers `generate`, side by side in one run.

(a) offline throughput: N requests, input/output lengths uniform in [lo, hi], ignore_eos;
(b) batch-1 decode: tokens/s and model-bandwidth utilisation (bytes read per step / step time /
    device-to-device copy bandwidth measured in the same run): default (CUDA graphs, fused
    elementwise ops, async scheduling), eager, and ``--b1-variants`` (each changing one feature);
(c) shared prefix: requests sharing a long system prompt, prefix caching on vs off (TTFT, tok/s);
(p) profile: per-step wall time split into scheduling / input prep / graph replay / sample+sync /
    output, the GPU-only replay time, and the eager kernel mix of a batch-1 decode step;
(r) roofline: a fixed offline batch (default 256 requests × 512 prompt → 256 output tokens) against
    the roofline of :mod:`hwkv.bench.roofline` (measured copy bandwidth and matmul rate), and HF
    generate on the same workload.

Random-weight models of realistic shape are written where the bench runs (no downloads) and loaded
through the normal loader path. JSON + Markdown land in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench import results_dir
from hwkv.bench.common import (
    SHAPES,
    backend,
    copy_bandwidth,
    decode_read_bytes,
    enable_weight_prefetch,
    free_engine,
    model_dir,
    resolved,
    workload,
)
from hwkv.bench.e2e_report import kernel_mix, markdown, profile, replay_ms

# Engine arguments the bench passes on its own: none. Every figure is what the public defaults give
# (docs/engine.md, device-aware); --engine-args changes them and the result prints them beside the figures.
ENGINE_DEFAULTS: dict[str, Any] = {}
# batch-1 runs beside the default one, each changing one fast-path feature
B1_VARIANTS = [dict(label="async scheduling off", engine=dict(async_scheduling=False)),
               dict(label="decode ops off", engine=dict(decode_ops=False)),
               dict(label="decode ops without PDL", env=dict(HWKV_CUDA_PDL="0"))]


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
    p.add_argument("--b1-tokens", type=int, default=512, help="batch-1 decode length")
    p.add_argument("--b1-variants", default=json.dumps(B1_VARIANTS),
                   help='JSON list of {"label", "engine": {Engine kwargs}, "env": {vars}} batch-1 runs')
    p.add_argument("--prefix-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--parts", default="a,b,c", help="comma list of a (throughput), b (batch-1), c (prefix), "
                                                    "p (profile), r (fixed batch vs roofline)")
    p.add_argument("--roofline-requests", type=int, default=256)
    p.add_argument("--roofline-in", type=int, default=512, help="prompt tokens per request (part r)")
    p.add_argument("--roofline-out", type=int, default=256, help="output tokens per request (part r)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    p.add_argument("--out-dir", default=None,
                   help="where e2e-<model>-<device>-<date>.{json,md} go (default: hwkv.bench.results_dir())")
    p.add_argument("--engine-args", default="{}", help="JSON dict of Engine kwargs (default: none, the public "
                   "defaults; any given is printed beside the figures)")


_model_dir = model_dir  # the name hwkv.bench.serve imports


def make_engine(mdir: Path, args: argparse.Namespace, **kw: Any) -> Any:
    opts = {**ENGINE_DEFAULTS, **json.loads(args.engine_args), **kw}
    prefetch = opts.pop("prefetch_weights", False)  # a bench-only experiment, not an Engine option
    be = backend(args.backend)
    # the previous engine's memory goes back first: free_engine(e) returns the allocator's cache while the
    # caller still holds e, and the default KV pool (memory_fraction of the free memory) is sized from what
    # the device reports free (H200, public defaults: 13.8 GiB left for the eager engine, which then failed)
    free_engine(None, be.device)
    engine = hwkv.Engine(str(mdir), backend=be, dtype=args.dtype, **opts)
    if prefetch:
        enable_weight_prefetch(engine)
    return engine


def run_engine(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from hwkv.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in work]
    engine.backend.device.synchronize()
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in work], params, use_tqdm=False)
    engine.backend.device.synchronize()
    dt = time.perf_counter() - t0
    ntok = sum(len(o.token_ids) for o in outs)
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    return dict(seconds=dt, requests=len(work), output_tokens=ntok, tok_per_s=ntok / dt,
                mean_ttft_s=sum(ttft) / len(ttft), p50_ttft_s=ttft[len(ttft) // 2])


def run_hf(model_dir: Path, work: list[tuple[list[int], int]], batch: int, dtype: str,
           device: Any) -> dict[str, float]:
    """HF `generate` at its best simple settings: bf16, SDPA, left padding, static batches sorted by
    output length so padding waste is small; ignore_eos via min_new_tokens. Only the tokens each
    request asked for are counted."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    ).to(device.torch_device).eval()
    work = sorted(work, key=lambda w: w[1])
    warm = torch.randint(100, 1000, (1, 16), device=device.torch_device)
    model.generate(warm, max_new_tokens=4, do_sample=False, pad_token_id=0)
    device.synchronize()
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
        at = device.torch_device
        model.generate(ids.to(at), attention_mask=mask.to(at), max_new_tokens=m, min_new_tokens=m,
                       do_sample=False, pad_token_id=0)
        ntok += sum(o for _, o in chunk)
    device.synchronize()
    dt = time.perf_counter() - t0
    del model
    free_engine(None, device)
    return dict(seconds=dt, output_tokens=ntok, tok_per_s=ntok / dt, batch=batch, requests=len(work))


def kv_bytes_per_token(cfg: dict[str, Any], elem: int = 2) -> int:
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * elem


def batch1(engine: Any, cfg: dict[str, Any], vocab: int, n_out: int, copy_bw: float | None) -> dict[str, Any]:
    """Decode tokens/s of one request and MBU = (weights + mean KV) bytes per step / step / copy BW."""
    prompt = workload(1, 128, 128, vocab, seed=1)[0][0]
    run_engine(engine, [(prompt, 16)])
    r = run_engine(engine, [(prompt, n_out)])
    step = (r["seconds"] - r["mean_ttft_s"]) / (n_out - 1)
    w = decode_read_bytes(engine.model)
    bytes_step = w + kv_bytes_per_token(cfg) * (len(prompt) + n_out / 2)
    b = dict(tok_per_s=1 / step, step_ms=step * 1e3, weight_bytes=w, bytes_per_step=bytes_step,
             graph_steps=engine.runner.num_graph_steps)
    gpu = replay_ms(engine, 1, len(prompt) + n_out)  # the graph of the last (longest) steps
    if gpu is not None:
        b["gpu_replay_ms_last"] = gpu
    if copy_bw:
        b["mbu"] = bytes_step / step / copy_bw
    return b


def roofline(engine: Any, cfg: dict[str, Any], args: argparse.Namespace, device: Any, copy_bw: float | None,
             n: int, n_in: int, n_out: int) -> dict[str, Any]:
    """:func:`hwkv.bench.roofline.offline_roofline` of ``n`` requests of ``n_in`` -> ``n_out`` on this device."""
    import torch

    from hwkv.bench.roofline import linear_params, matmul_rate, offline_roofline

    host = device.torch_device.type == "cpu"
    bw = copy_bw or copy_bandwidth(device, 1 << 24)
    rate = matmul_rate(device, getattr(torch, args.dtype), n=256 if host else 8192)
    body, head = linear_params(engine.model)
    kv = kv_bytes_per_token(cfg, torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    return offline_roofline(cfg, body, head, decode_read_bytes(engine.model), kv, n, n_in, n_out, bw, rate)


def part_r(engine: Any, cfg: dict[str, Any], work: list[tuple[list[int], int]], args: argparse.Namespace,
           device: Any, copy_bw: float | None, res: dict[str, Any]) -> None:
    """The fixed batch, timed after an untimed pass of the same shape (other tokens: no prefix hits),
    against its roofline. On the host (no device figures) both rates are measured small, for the
    formula's sake only."""
    import torch

    from hwkv.bench.roofline import linear_params, matmul_rate, offline_roofline

    n, n_in, n_out = len(work), args.roofline_in, args.roofline_out
    host = device.torch_device.type == "cpu"
    bw = copy_bw or copy_bandwidth(device, 1 << 24)
    rate = matmul_rate(device, getattr(torch, args.dtype), n=256 if host else 8192)
    run_engine(engine, [(p, n_out) for p, _ in workload(n, n_in, n_in, cfg["vocab_size"], seed=6)])
    r = run_engine(engine, work)
    body, head = linear_params(engine.model)
    kv = kv_bytes_per_token(cfg, torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    roof = offline_roofline(cfg, body, head, decode_read_bytes(engine.model), kv, n, n_in, n_out, bw, rate)
    res["roofline"] = dict(workload=f"{n} req × {n_in} in → {n_out} out (ignore_eos)", hwkv=r, roofline=roof,
                           efficiency=r["tok_per_s"] / roof["tok_per_s"], host_rates=host)


def run(args: argparse.Namespace) -> int:
    import torch

    mdir = model_dir(args)
    cfg = json.loads((mdir / "config.json").read_text())
    vocab = cfg["vocab_size"]
    device = backend(args.backend).device
    dev = device.description().split(" (")[0]
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    res: dict[str, Any] = dict(
        bench="e2e", model=args.model, dtype=args.dtype, backend=args.backend, device=dev,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), command="hwkv bench e2e " + shlex.join(sys.argv[3:]),
        torch=torch.__version__, transformers=tf_version, hwkv=hwkv.__version__, min_len=args.min_len,
        max_len=args.max_len, engine={**ENGINE_DEFAULTS, **json.loads(args.engine_args)}, errors=[],
    )
    copy_bw = copy_bandwidth(device) if device.torch_device.type != "cpu" else None  # host: not an HBM figure
    res["copy_bw_TBps"] = copy_bw / 1e12 if copy_bw else None
    parts = set(args.parts.split(","))
    stem = f"e2e-{Path(args.model).name}-{dev.replace(' ', '_')}-{time.strftime('%Y-%m-%d')}"
    out_dir = Path(args.out_dir) if args.out_dir else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2))
        (out_dir / f"{stem}.md").write_text(markdown(res))

    def part(name: str, fn: Any) -> None:
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # one failing part must not lose the others' numbers
            import traceback

            traceback.print_exc()
            res["errors"].append(f"{name}: {type(e).__name__}: {e}")
        print(f"[e2e] part {name}: {time.perf_counter() - t:.1f} s", flush=True)
        save()

    t0 = time.perf_counter()
    engine = make_engine(mdir, args)
    res["engine_init_s"] = time.perf_counter() - t0
    res["resolved"] = resolved(engine)
    print(f"[e2e] non-default engine arguments: {res['engine'] or 'none'}; resolved: {res['resolved']}", flush=True)
    res["graph_buckets"] = engine.runner.graphs.buckets if engine.runner.graphs is not None else None
    work = workload(args.num_requests, args.min_len, args.max_len, vocab)

    def part_a() -> None:
        # untimed pass over a workload of the same shape but other tokens (the same tokens would make the
        # timed pass a prefix-cache hit): Triton compiles a kernel variant on its first use (tiles and
        # split counts follow the batch), and a cold cache cost the timed run up to 30 % (H100)
        run_engine(engine, workload(args.num_requests, args.min_len, args.max_len, vocab, seed=1))
        before = engine.stats()
        res["throughput"] = dict(hwkv=run_engine(engine, work), stats=engine.stats())
        # the timed pass alone: a prefix-cache hit there would mean prefill was skipped
        res["throughput"]["timed_prefix_cache_hits"] = (res["throughput"]["stats"]["prefix_cache_hits"]
                                                        - before["prefix_cache_hits"])
        # the roofline of a fixed batch at the workload's mean lengths (the lengths vary: approximate)
        n_in = round(sum(len(p) for p, _ in work) / len(work))
        n_out = round(sum(m for _, m in work) / len(work))
        roof = roofline(engine, cfg, args, device, copy_bw, len(work), n_in, n_out)
        res["throughput"]["roofline_tok_per_s"] = roof["tok_per_s"]
        res["throughput"]["roofline_fraction"] = res["throughput"]["hwkv"]["tok_per_s"] / roof["tok_per_s"]

    def part_b() -> None:
        res["batch1"] = batch1(engine, cfg, vocab, args.b1_tokens, copy_bw)

    def part_p() -> None:
        res["profile"] = {f"batch {b}": profile(engine, vocab, b) for b in (1, 64, 256)
                          if b <= engine.config.scheduler.max_num_seqs}
        res["kernel_mix"] = kernel_mix(engine)
        from hwkv.bench.timeline import graph_timeline

        res["graph_timeline"] = graph_timeline(engine)

    if "b" in parts:
        part("b", part_b)
    if "p" in parts:
        part("p", part_p)
    if "a" in parts:
        part("a", part_a)
    rwork = [(p, args.roofline_out) for p, _ in workload(args.roofline_requests, args.roofline_in,
                                                          args.roofline_in, vocab, seed=5)]
    if "r" in parts:
        part("r", lambda: part_r(engine, cfg, rwork, args, device, copy_bw, res))
    free_engine(engine, device)
    engine = None
    if "b" in parts:
        def part_b_eager() -> None:
            e = make_engine(mdir, args, enforce_eager=True, max_num_seqs=4)
            res["batch1"]["eager"] = batch1(e, cfg, vocab, min(args.b1_tokens, 256), copy_bw)
            free_engine(e, device)
        part("b-eager", part_b_eager)

        for v in json.loads(args.b1_variants):
            def part_b_variant(v: dict[str, Any] = v) -> None:
                old = {k: os.environ.get(k) for k in v.get("env", {})}
                os.environ.update(v.get("env", {}))  # read when the engine captures its graphs
                try:
                    e = make_engine(mdir, args, max_num_seqs=4, **v.get("engine", {}))
                    res.setdefault("batch1_variants", {})[v["label"]] = dict(
                        batch1(e, cfg, vocab, args.b1_tokens, copy_bw), **v)
                    free_engine(e, device)
                finally:
                    for k, val in old.items():
                        os.environ.pop(k) if val is None else os.environ.__setitem__(k, val)
            part(f"b[{v['label']}]", part_b_variant)
    if not args.no_hf and "a" in parts:
        def part_a_hf() -> None:
            hf = run_hf(mdir, work[: args.hf_requests], args.hf_batch, args.dtype, device)
            res["throughput"]["hf"] = hf
            res["throughput"]["ratio"] = res["throughput"]["hwkv"]["tok_per_s"] / hf["tok_per_s"]
        part("a-hf", part_a_hf)
    if not args.no_hf and "r" in parts and "roofline" in res:
        def part_r_hf() -> None:
            hf = run_hf(mdir, rwork[: args.hf_requests], args.hf_batch, args.dtype, device)
            res["roofline"]["hf"] = hf
            res["roofline"]["ratio"] = res["roofline"]["hwkv"]["tok_per_s"] / hf["tok_per_s"]
        part("r-hf", part_r_hf)
    if not args.no_hf and "b" in parts:
        def part_b_hf() -> None:
            prompt = workload(1, 128, 128, vocab, seed=1)[0][0]
            res["batch1"]["hf_tok_per_s"] = run_hf(mdir, [(prompt, 128)], 1, args.dtype, device)["tok_per_s"]
        part("b-hf", part_b_hf)
    if "c" in parts:
        def part_c() -> None:
            rng = random.Random(2)
            system = [rng.randrange(100, vocab - 100) for _ in range(args.prefix_len)]
            reqs = [(system + [rng.randrange(100, vocab - 100) for _ in range(64)], 64)
                    for _ in range(args.prefix_requests)]
            c: dict[str, Any] = dict(workload=f"{len(reqs)} req × ({args.prefix_len} shared + 64) in, 64 out")
            for on in (True, False):
                e = make_engine(mdir, args, enable_prefix_caching=on)
                run_engine(e, [(rng.sample(range(100, vocab - 100), args.prefix_len + 64), 4)])  # warm-up, unshared
                c["prefix_on" if on else "prefix_off"] = run_engine(e, reqs)
                c["stats_on" if on else "stats_off"] = e.stats()
                free_engine(e, device)
            res["shared_prefix"] = c
        part("c", part_c)
    save()
    print(markdown(res))
    return 0 if not res["errors"] else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="hwkv bench e2e")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))

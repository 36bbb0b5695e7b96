"""`hwkv bench offload`: the CPU offload connector on a backend, four parts.

(copy)   device <-> host copy bandwidth of KV blocks of the model's real geometry, per length of the
         contiguous runs (both sides consecutive), through the connector's copy path (merged runs
         by memcpy, scattered blocks by ``Device.copy_blocks``) on a side stream, timed with events;
(ttft)   time to first token of a long prompt whose prefix is in the host tier (loaded) vs the same
         length with no hit anywhere (recomputed), in one engine, the device prefix cache emptied;
(decode) generation throughput with the connector on vs off on a workload with no hits (the
         connector still stores every newly full block: its whole cost on the fast path), and the
         host time per step spent inside the connector's hooks;
(preempt) a device pool too small for the batch, on vs off (:mod:`hwkv.bench.offload_preempt`).

Random-weight models of realistic shape are written where the bench runs (``hwkv bench e2e``'s
shapes, or ``tiny`` for a CPU smoke run). JSON lands in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench import results_dir
from hwkv.bench.common import backend as get_backend
from hwkv.bench.common import free_engine, model_dir, offload_engine
from hwkv.bench.offload_preempt import HookTimer, bench_preempt


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b", help="a local HF dir, a `hwkv bench e2e` shape, or tiny")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--parts", default="copy,ttft,decode,preempt")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: the backend's)")
    p.add_argument("--copy-blocks", type=int, default=2048, help="device blocks in the copy test")
    p.add_argument("--run-blocks", default="1,4,16,64,256", help="run lengths (blocks) to measure")
    p.add_argument("--prompt-len", type=int, default=8192, help="TTFT prompt length (tokens)")
    p.add_argument("--ttft-reps", type=int, default=3)
    p.add_argument("--decode-requests", type=int, default=64)
    p.add_argument("--decode-prompt", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--preempt-requests", type=int, default=32, help="preempt part: requests (decode prompt/tokens)")
    p.add_argument("--preempt-blocks", type=int, default=None,
                   help="preempt part: device KV blocks (default: a third of what the requests need)")
    p.add_argument("--cpu-gb", type=float, default=8.0, help="host tier size for the ttft/decode parts")
    p.add_argument("--store-batch-blocks", type=int, default=None, help="offload config (default: the connector's)")
    p.add_argument("--offload-config", type=json.loads, default={},
                   help='more offload config as JSON, e.g. \'{"layerwise_load": false}\' (see `hwkv connectors`)')
    p.add_argument("--out-dir", default=None, help="where the JSON goes (default: hwkv.bench.results_dir())")


def _timed(dev: Any, stream: Any, fn: Any, iters: int = 5) -> float:
    """Median seconds of ``fn()`` queued on ``stream``, timed by events recorded on it."""
    fn()  # warm-up
    dev.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        s, e = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
        s.record(stream)
        fn()
        e.record(stream)
        e.synchronize()
        ms = s.elapsed_time(e)
        times.append(ms / 1e3 if ms > 0 else time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def bench_copy(args: argparse.Namespace, be: Any, model: Any, block_size: int) -> list[dict[str, Any]]:
    from hwkv.connectors.base.copy import copy_block_pairs

    dev, n = be.device, args.copy_blocks
    spec = model.kv_cache_spec(n, block_size)
    gpu = dev.allocate_kv_cache(spec, be.attention.kv_layout)
    host = dev.allocate_kv_cache(replace(spec, num_blocks=n), be.attention.kv_layout, host=True)
    stream, rows = dev.new_stream(), []
    for run in map(int, args.run_blocks.split(",")):
        runs = max(1, n // (run + 1))  # a one-block gap between runs keeps them apart
        ids = [k * (run + 1) + j for k in range(runs) for j in range(run) if k * (run + 1) + j < n]
        nbytes = len(ids) * spec.bytes_per_block
        for mode, min_run in (("memcpy runs", 1), ("copy_blocks", 1 << 30), ("auto", None)):
            row = {"run_blocks": run, "run_bytes_per_tensor": run * gpu.block_nbytes(0), "mode": mode,
                   "bytes": nbytes}
            for name, src, dst in (("d2h", gpu, host), ("h2d", host, gpu)):
                t = _timed(dev, stream, lambda s=src, d=dst, m=min_run, i=ids: copy_block_pairs(dev, s, d, i, i,
                                                                                               stream, m))
                row[f"{name}_GBps"] = round(nbytes / t / 1e9, 2)
            rows.append(row)
            print(f"copy run={run:4d} blocks ({row['run_bytes_per_tensor'] / 2**20:.2f} MiB/tensor) {mode:12s} "
                  f"d2h {row['d2h_GBps']:7.2f} GB/s  h2d {row['h2d_GBps']:7.2f} GB/s", flush=True)
    del gpu, host
    return rows


def _settle(e: Any) -> None:
    for _ in range(1000):
        if not e.scheduler.connector.has_pending_transfers():
            return
        e.backend.device.synchronize()
        e.step()
    raise RuntimeError("offload transfers did not complete")


class _LoadTimer:
    """Times the offload worker side's loads of one ``generate``: host time issuing them (``start_load_kv``)
    and device time of the copies (events on the load stream around ``load_blocks``)."""

    def __init__(self, conn: Any):
        self.conn, self.issue_s, self.pairs = conn, 0.0, []
        load, start = conn.load_blocks, conn.start_load_kv

        def timed_load(host_ids: list[int], device_ids: list[int], layer: int | None = None) -> None:
            dev, stream = conn.dev, conn._load_stream
            s, e = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
            s.record(stream)
            load(host_ids, device_ids, layer)
            e.record(stream)
            self.pairs.append((s, e))

        def timed_start() -> None:
            t0 = time.perf_counter()
            start()
            self.issue_s += time.perf_counter() - t0

        conn.load_blocks, conn.start_load_kv = timed_load, timed_start

    def reset(self) -> None:
        self.issue_s, self.pairs = 0.0, []

    def copy_s(self) -> float:
        out = 0.0
        for s, e in self.pairs:
            e.synchronize()
            out += s.elapsed_time(e) / 1e3
        return out


def bench_ttft(args: argparse.Namespace, mdir: Path) -> dict[str, Any]:
    """Loaded vs recomputed TTFT, and where the loaded one goes: the same prompt again with its
    prefix in the device prefix cache (no copy: engine + the last block's forward over the whole
    context), the load copies' device time and the host time issuing them; the rest is unexplained."""

    n, vocab = args.prompt_len, None
    e = offload_engine(mdir, args, True, max_model_len=n + 64, max_num_seqs=8, max_num_batched_tokens=max(8192, n + 64))
    vocab = e.vocab_size
    rng = random.Random(0)
    one = hwkv.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timer = _LoadTimer(e.scheduler.connector.worker)

    def prompt(m: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(m)]

    def ttft(p: list[int]) -> float:
        e.backend.device.synchronize()
        t0 = time.perf_counter()
        e.generate([p], one, use_tqdm=False)
        return time.perf_counter() - t0

    e.generate([prompt(256)], one, use_tqdm=False)  # warm-up (kernels, allocator)
    loaded, recomputed, device_hit, copy, issue = [], [], [], [], []
    for _ in range(args.ttft_reps):
        base = prompt(n - 16)
        e.generate([base], one, use_tqdm=False)  # its full blocks go to the host tier
        _settle(e)
        assert e.kv_cache_manager.reset_prefix_cache(), "device blocks still held"
        before = e.stats()["kv_connector"]["external_hit_tokens"]
        p = base + prompt(16)
        timer.reset()
        loaded.append(ttft(p))
        copy.append(timer.copy_s())
        issue.append(timer.issue_s)
        hit = e.stats()["kv_connector"]["external_hit_tokens"] - before
        _settle(e)
        device_hit.append(ttft(p))  # its prefix is now in the device prefix cache: no load
        _settle(e)
        e.kv_cache_manager.reset_prefix_cache()
        recomputed.append(ttft(prompt(n)))
        _settle(e)
        e.kv_cache_manager.reset_prefix_cache()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    res = {"prompt_len": n, "host_hit_tokens": hit, "ttft_loaded_s": med(loaded),
           "ttft_recomputed_s": med(recomputed), "ttft_device_hit_s": med(device_hit),
           "load_copy_s": med(copy), "load_issue_s": med(issue)}
    # steps served by the short-query graphs (the tails of the loaded and device-hit runs): 0 = eager
    res["tail_graph_steps"] = getattr(e.runner, "num_tail_graph_steps", 0)
    res["speedup"] = round(res["ttft_recomputed_s"] / res["ttft_loaded_s"], 2)
    res["unexplained_s"] = res["ttft_loaded_s"] - res["ttft_device_hit_s"] - res["load_copy_s"]
    print(f"ttft {n} tokens: host tier {res['ttft_loaded_s'] * 1e3:.1f} ms ({hit} tokens loaded), "
          f"recomputed {res['ttft_recomputed_s'] * 1e3:.1f} ms: {res['speedup']}x; loaded = device-prefix-hit "
          f"TTFT {res['ttft_device_hit_s'] * 1e3:.1f} ms + load copy {res['load_copy_s'] * 1e3:.1f} ms (issued in "
          f"{res['load_issue_s'] * 1e3:.2f} ms host) + {res['unexplained_s'] * 1e3:.1f} ms other; "
          f"{res['tail_graph_steps']} tail steps replayed graphs", flush=True)
    free_engine(e, e.backend.device)
    return res


def bench_decode(args: argparse.Namespace, mdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": args.decode_requests, "prompt_len": args.decode_prompt,
                           "output_len": args.decode_tokens}
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for offload in (False, True, False, True):  # interleaved: drift hits both alike
        e = offload_engine(mdir, args, offload, max_model_len=args.decode_prompt + args.decode_tokens + 16,
                    max_num_seqs=args.decode_requests)
        rng = random.Random(1)  # distinct random prompts: no prefix hits on either tier
        prompts = [[rng.randrange(100, e.vocab_size - 100) for _ in range(args.decode_prompt)]
                   for _ in range(args.decode_requests)]
        e.generate(prompts[:2], hwkv.SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        hooks = HookTimer(e.scheduler.connector) if offload else None
        steps0 = e.stats()["num_steps"]
        e.backend.device.synchronize()
        t0 = time.perf_counter()
        e.generate(prompts, params, use_tqdm=False)
        e.backend.device.synchronize()
        tps = args.decode_requests * args.decode_tokens / (time.perf_counter() - t0)
        if hooks is not None:  # the connector's own host cost per step, free of the step-time noise
            us = hooks.s / max(1, e.stats()["num_steps"] - steps0) * 1e6
            out["connector_host_us_per_step"] = round(min(out.get("connector_host_us_per_step", us), us), 1)
        key = "on" if offload else "off"
        out[f"tok_per_s_{key}"] = max(out.get(f"tok_per_s_{key}", 0.0), round(tps, 1))
        if offload:
            st = e.stats()["kv_connector"]
            assert st["external_hit_tokens"] == 0, st
            out["stored_bytes"] = st["stored_bytes"]
        free_engine(e, e.backend.device)
    out["ratio"] = round(out["tok_per_s_on"] / out["tok_per_s_off"], 4)
    print(f"decode {args.decode_requests} x {args.decode_tokens}: off {out['tok_per_s_off']} tok/s, "
          f"on {out['tok_per_s_on']} tok/s (ratio {out['ratio']}); connector hooks "
          f"{out['connector_host_us_per_step']} us of host time per step", flush=True)
    return out


def run(args: argparse.Namespace) -> int:
    from hwkv.model import load_model

    parts = set(args.parts.split(","))
    known = {"copy", "ttft", "decode", "preempt"}
    if parts - known:
        raise SystemExit(f"--parts: unknown {sorted(parts - known)} (allowed: copy,ttft,decode,preempt)")
    mdir = model_dir(args)
    be = get_backend(args.backend)
    if not isinstance(args.offload_config, dict):
        raise SystemExit(f"--offload-config: a JSON object expected, got {args.offload_config!r}")
    result: dict[str, Any] = {"backend": args.backend, "device": be.device.description(), "model": args.model,
                              "dtype": args.dtype, "offload_config": args.offload_config}
    if "copy" in parts:
        model = load_model(str(mdir), be, dtype=args.dtype, load_tokenizer=False)[0]
        bs = args.block_size or be.capabilities.default_block_size
        result["block_size"] = bs
        result["copy"] = bench_copy(args, be, model, bs)
        del model
        gc.collect()
        be.device.empty_cache()
    if "ttft" in parts:
        result["ttft"] = bench_ttft(args, mdir)
    if "decode" in parts:
        result["decode"] = bench_decode(args, mdir)
    if "preempt" in parts:
        result["preempt"] = bench_preempt(args, mdir, args.block_size or be.capabilities.default_block_size)
    out = Path(args.out_dir) if args.out_dir else results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"offload-{args.backend}-{args.model.replace('/', '_')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0

"""`hwkv bench kv-dtype`: fp8 KV cache against the model-dtype cache, side by side in one run.

For each ``--kv-dtypes`` value one engine (``kv_cache_dtype=...``, every other Engine argument the
public default unless ``--engine-args`` says otherwise; printed next to the figures):

* **decode step** at ``--decode-context`` tokens × ``--decode-batch`` requests: the model's decode
  forward over scattered pages of a filled KV pool (random KV of the cache dtype), captured as one
  CUDA graph and replayed (what the engine replays for a pure-decode step, without its host work);
  tok/s = batch / step time, and the bytes the step must read (weights + KV) against the device's
  copy bandwidth measured in the same run;
* **capacity**: the KV pool's blocks and how many ``--capacity-context``-token sequences it holds;
* **greedy agreement**: ``--agree-prompts`` random prompts × ``--agree-tokens`` greedy tokens through
  ``generate`` vs the first kv dtype's; first-divergence position per prompt (None: identical);
* **bytes**: what offload, pool and P/D move per block (``KVCache.segments``, the byte ranges all
  three connectors copy);
* ``--moved-bytes``: the bytes the offload connector (host tier) and the p2p connector (pull, tcp on
  loopback) really moved per KV token, from their counters, through small engines of this model
  (:func:`moved_bytes`; host memory only, so it runs on the CPU backend too).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hwkv.bench.common import (
    copy_bandwidth,
    decode_read_bytes,
    engine_bench,
    free_engine,
    result_path,
    workload,
    write_result,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--kv-dtypes", default="auto,fp8", help="comma list of kv_cache_dtype values; the first is the base")
    p.add_argument("--decode-batch", type=int, default=32, help="0: no decode-step timing")
    p.add_argument("--decode-context", type=int, default=32768)
    p.add_argument("--decode-reps", type=int, default=20)
    p.add_argument("--capacity-context", type=int, default=8192)
    p.add_argument("--agree-prompts", type=int, default=8)
    p.add_argument("--agree-prompt-len", type=int, default=256)
    p.add_argument("--agree-tokens", type=int, default=64)
    p.add_argument("--engine-args", default="{}", help="JSON dict of Engine kwargs (default: the public defaults, "
                   "except max_model_len = the decode context + 64, enforce_eager and fuse_elementwise: the forward "
                   "the default graphs replay, captured by the bench itself)")
    p.add_argument("--moved-bytes", action="store_true", help="also measure offload and p2p bytes per KV token")
    p.add_argument("--profile", action="store_true", help="per-kernel GPU time of the decode step (torch.profiler "
                   "over graph replays and over eager forwards)")
    p.add_argument("--out", default=None)


def kernel_table(run: Any, steps: int, sync: Any) -> list[dict[str, Any]]:
    """GPU kernels of ``steps`` calls of ``run`` under torch.profiler, by name: us per call, launches per
    call, longest first (kernel events only: no CPU op's device total, which would count them twice)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        sync()
    agg: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            a = agg.setdefault(ev.name, [0.0, 0])
            a[0] += ev.time_range.elapsed_us()
            a[1] += 1
    rows = [dict(name=k[:140], us_per_step=v[0] / steps, launches_per_step=v[1] / steps) for k, v in agg.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def decode_step(engine: Any, batch: int, ctx: int, reps: int, profile: bool = False) -> dict[str, Any]:
    """Time one decode forward of ``batch`` requests at ``ctx`` tokens over randomly scattered pages.
    ``profile``: also the per-kernel table of the graph replay and of the eager forward."""
    import torch

    from hwkv.interfaces.attention import AttentionMetadata

    dev = engine.backend.device
    kv, bs, model = engine.kv_cache, engine.block_size, engine.model
    nblk = -(-ctx // bs)
    if batch * nblk > kv.spec.num_blocks:
        raise ValueError(f"{batch} x {ctx} tokens need {batch * nblk} blocks; the pool has {kv.spec.num_blocks}")
    g = torch.Generator(device=dev.torch_device).manual_seed(0)
    for t in kv.tensors:  # random KV of the cache's dtype, one layer at a time (no NaN: e4m3 from floats)
        for i in range(t.shape[0] // 4096 + 1):
            part = t[i * 4096:(i + 1) * 4096]
            if part.numel():
                part.copy_(torch.randn(part.shape, generator=g, device=t.device).mul_(0.5).to(t.dtype))
    tables = torch.randperm(kv.spec.num_blocks, generator=g, device=dev.torch_device)[:batch * nblk]
    tables = tables.view(batch, nblk).to(torch.int32).cpu()
    md = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, bs, device=dev.torch_device)
    built = engine.backend.attention.metadata_builder().build(md)
    ids = torch.randint(0, engine.vocab_size, (batch,), device=dev.torch_device)
    pos = torch.full((batch,), ctx - 1, dtype=torch.long, device=dev.torch_device)
    rows = torch.arange(batch, device=dev.torch_device)

    def fwd() -> Any:
        return model.forward(ids, pos, kv, built, rows, md.slot_mapping)

    for _ in range(3):
        fwd()
    dev.synchronize()
    graph = None
    if dev.torch_device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fwd()
    replay = graph.replay if graph is not None else fwd
    for _ in range(3):
        replay()
    s, e = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    step = times[len(times) // 2]
    prof = {}
    if profile:
        prof["graph"] = kernel_table(replay, 5, dev.synchronize)
        prof["eager"] = kernel_table(fwd, 5, dev.synchronize)
        for k, rows in prof.items():
            print(f"[kv-dtype] {kv.spec.dtype} {k}: {sum(r['us_per_step'] for r in rows):.0f} us of kernels a step",
                  flush=True)
            for r in rows[:14]:
                print(f"    {r['us_per_step']:9.1f} us  x{r['launches_per_step']:<5g} {r['name'][:110]}", flush=True)
    kv_bytes = batch * ctx * kv.spec.bytes_per_block // bs
    w = decode_read_bytes(model)
    del graph
    return dict(batch=batch, context=ctx, step_ms=step * 1e3, tok_per_s=batch / step, weight_bytes=w,
                kv_bytes=kv_bytes, bytes_per_step=w + kv_bytes, read_TBps=(w + kv_bytes) / step / 1e12,
                min_ms=times[0] * 1e3, max_ms=times[-1] * 1e3, **({"kernels": prof} if prof else {}))


def moved_bytes(mdir: Path, be: Any, dtype: str, kd: str, vocab: int, block_size: int = 16) -> dict[str, Any]:
    """Bytes per KV token the offload and the p2p connector moved for ``kv_cache_dtype=kd``, from their
    counters. Offload: a 4-block prefix, evicted from an 8-block device pool by a filler, comes back
    from the host tier for its 2nd and 3rd user. p2p (pull, tcp on loopback, needs Mooncake's
    transfer engine): a producer prefills 3 prompts, a consumer loads their full blocks and decodes (an fp8
    cache's V pages move whole: a load's last, partial block carries its page, hwkv.connectors.p2p.protocol)."""
    import random

    import hwkv
    from hwkv.sampling_params import SamplingParams

    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(backend=be, dtype=dtype, kv_cache_dtype=kd, block_size=block_size, max_model_len=8 * block_size,
              enforce_eager=True)
    out: dict[str, Any] = {}
    prefix = [rng.randrange(100, vocab - 100) for _ in range(4 * block_size)]
    work = []
    for _ in range(3):
        work.append([rng.randrange(100, vocab - 100) for _ in range(8 * block_size - 10)])
        work.append(prefix + [rng.randrange(100, vocab - 100) for _ in range(5)])
    e = hwkv.Engine(str(mdir), num_kv_blocks=8, kv_connector="offload", kv_connector_config={"cpu_bytes": 64 << 20},
                    **kw)
    for p in work:
        e.generate([p], greedy, use_tqdm=False)
    for _ in range(50):  # stores finish on the steps after their request
        if not e.scheduler.connector.has_pending_transfers():
            break
        e.step()
    st = e.stats()["kv_connector"]
    out["offload"] = dict(loaded_bytes=st["loaded_bytes"], loaded_tokens=st["external_hit_tokens"],
                          stored_bytes=st["stored_bytes"],
                          loaded_bytes_per_token=st["loaded_bytes"] / max(1, st["external_hit_tokens"]))
    e.close()
    from hwkv.stores.mooncake_service import mooncake_available

    ok, why = mooncake_available()  # the tcp transfer engine the p2p connector uses here
    if not ok:
        out["p2p"] = dict(skipped=why)
        return out
    cfg = lambda role: dict(role=role, mode="pull", transfer_timeout_s=10.0)
    prod = hwkv.Engine(str(mdir), num_kv_blocks=32, kv_connector="p2p", kv_connector_config=cfg("producer"), **kw)
    cons = hwkv.Engine(str(mdir), num_kv_blocks=32, kv_connector="p2p", kv_connector_config=cfg("consumer"), **kw)
    try:
        for p in work[1::2]:
            sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                kv_transfer_params={"do_remote_decode": True})
            params = prod.generate([p], sp, use_tqdm=False)[0].kv_transfer_params
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, kv_transfer_params=params)
            cons.generate([p], sp, use_tqdm=False)
        st = cons.stats()["kv_connector"]
        out["p2p"] = dict(loaded_bytes=st["loaded_bytes"], loaded_tokens=st["external_hit_tokens"],
                          loaded_bytes_per_token=st["loaded_bytes"] / max(1, st["external_hit_tokens"]),
                          loads=len(work[1::2]))
    finally:
        prod.close()
        cons.close()
    return out


def one_kv_dtype(args: argparse.Namespace, mdir: Path, be: Any, kd: str, kw: dict[str, Any], work: list[Any],
                 params: Any, base_tokens: list[list[int]] | None) -> tuple[dict[str, Any], list[list[int]]]:
    """One engine with ``kv_cache_dtype=kd``: its figures and greedy tokens (the engine is dropped on return)."""
    import hwkv

    t0 = time.perf_counter()
    e = hwkv.Engine(str(mdir), backend=be, dtype=args.dtype, kv_cache_dtype=kd, **kw)
    r: dict[str, Any] = dict(engine_init_s=time.perf_counter() - t0, kv_storage=str(e.kv_cache.spec.dtype),
                             num_kv_blocks=e.config.cache.num_kv_blocks, block_size=e.block_size,
                             bytes_per_block=e.kv_cache.spec.bytes_per_block)
    r["capacity_sequences"] = e.config.cache.num_kv_blocks * e.block_size // args.capacity_context
    r["connector_bytes_64_blocks"] = sum(s.nbytes for s in e.kv_cache.segments(list(range(64))))
    toks = [list(o.token_ids) for o in e.generate([p for p, _ in work], params, use_tqdm=False)]
    base = base_tokens or toks
    r["first_divergence"] = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                             for x, y in zip(base, toks)]
    r["identical_prompts"] = sum(d is None for d in r["first_divergence"])
    if args.decode_batch > 0:
        r["decode"] = decode_step(e, args.decode_batch, args.decode_context, args.decode_reps, args.profile)
    if args.moved_bytes:
        e.close()
        r["moved_bytes"] = moved_bytes(mdir, be, args.dtype, kd, e.vocab_size)
    return r, toks


def run(args: argparse.Namespace) -> int:

    from hwkv.sampling_params import SamplingParams

    eb = engine_bench(args)
    mdir, cfg, be, dev, extra = eb.model_dir, eb.config, eb.backend, eb.device, eb.engine_args
    # The decode step is the forward the public defaults' graphs replay: fused elementwise ops (what graphs turn
    # on; on CUDA the backend's Triton kernels, nothing compiled) in a CUDA graph the bench captures itself. The
    # engine's own capture of every batch bucket is skipped (enforce_eager): it is ~40 s of a 1B engine's start,
    # twice per run, and the timed step would not replay it.
    # (fuse_elementwise only where the defaults would capture graphs: on the CPU backend they capture none.)
    kw = dict(max_model_len=args.decode_context + 64, enforce_eager=True,
              fuse_elementwise=bool(be.capabilities.graph_capture))
    kw.update(extra)
    res: dict[str, Any] = eb.header("kv-dtype", args, engine_args=kw, runs={})
    print(f"[kv-dtype] non-default engine arguments: {kw}", flush=True)
    bw = copy_bandwidth(dev) if dev.torch_device.type != "cpu" else None
    res["copy_bw_TBps"] = bw / 1e12 if bw else None
    work = [(p, args.agree_tokens) for p, _ in workload(args.agree_prompts, args.agree_prompt_len,
                                                        args.agree_prompt_len, cfg["vocab_size"], seed=3)]
    params = SamplingParams(temperature=0.0, max_tokens=args.agree_tokens, ignore_eos=True)
    base_tokens = None
    for kd in args.kv_dtypes.split(","):
        r, toks = one_kv_dtype(args, mdir, be, kd, kw, work, params, base_tokens)
        base_tokens = base_tokens or toks
        if r.get("decode") and bw:
            r["decode"]["fraction_of_copy_bw"] = r["decode"]["bytes_per_step"] / (r["decode"]["step_ms"] / 1e3) / bw
        res["runs"][kd] = r
        print(f"[kv-dtype] {kd}: {json.dumps(r)}", flush=True)
        free_engine(None, dev)  # the engine died with one_kv_dtype's frame: return its memory before the next
    kds = args.kv_dtypes.split(",")
    base, other = res["runs"][kds[0]], res["runs"][kds[-1]]
    res["ratios"] = dict(capacity=other["capacity_sequences"] / max(1, base["capacity_sequences"]),
                         bytes_per_block=other["bytes_per_block"] / base["bytes_per_block"])
    if "decode" in base and "decode" in other:
        res["ratios"]["decode_tok_per_s"] = other["decode"]["tok_per_s"] / base["decode"]["tok_per_s"]
    for conn in ("offload", "p2p"):
        b, o = (r.get("moved_bytes", {}).get(conn, {}).get("loaded_bytes_per_token") for r in (base, other))
        if b and o:
            res["ratios"][f"{conn}_bytes_per_token"] = o / b
    print(json.dumps(res["ratios"]), flush=True)
    write_result(result_path(args, "kv-dtype"), res)
    return 0


if __name__ == "__main__":
    import sys

    ap = argparse.ArgumentParser(prog="hwkv bench kv-dtype")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))

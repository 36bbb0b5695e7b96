"""``hwkv bench pool-restart``: TTFT of the first shared-prefix request on a freshly started engine,
with the persistent pool vs without.

A real ``mooncake_master`` and a memory holder (Mooncake's ``mooncake_client``, as ``hwkv pool
master --capacity`` starts) hold the pool; engines contribute no memory (``global_segment_size=0``).

1. *fill*: an engine process serves one request of a ``--prompt-len`` shared prefix (a system prompt)
   plus a suffix, lets its puts land, and exits;
2. *pool*: a new engine process (the restarted or scaled-out instance) with the pool connector, once
   per ``--via``: ``holder`` (attached to the holder on this host, values through shared memory) and
   ``tcp`` (a plain client: values over the transfer engine's tcp, as from another host);
3. *none*: a new engine process without a connector (what a restart costs today).

In 2 and 3 the engine first serves a warm-up request of exactly the measured one's shape: another
prefix of ``--prompt-len`` tokens that the fill also put (so the pool runs load it), plus a suffix of
``--suffix-len`` new tokens, so first-use costs of that shape (kernel compilation for a prefill of
the suffix over a loaded prefix) are nobody's. (Until 2026-11-28 the warm-up was a fresh prompt: its
load left 16 tokens to compute where the measured request computes 32, and the first pool variant
measured ~2 s more than the next one, which may have found the compiled kernels on disk.) Then the
measured one: the same prefix with another suffix, ``max_tokens=1``; TTFT is that ``generate`` call's
wall time, best of ``--repeats`` fresh processes. The tokens of 2 and 3 must be
identical (checked). The measured pool processes load only (``save=False``), so each finds exactly
what the fill put. Each pool run also reports where its load's time went (the connector's
``load_*_s`` counters over the measured request only): the store's get calls, waiting for the
staging -> device copies, and the rest of the TTFT (lookup, scheduling, the suffix's prefill).
Results: ``pool-restart-<model>-<backend>-<date>.json``.

``--one-process`` needs one engine start per ``--via`` instead of four in all (an 8B start takes ~40 s
on the device): the engine recomputes the prompt, its chunks reach the pool, its device prefix cache
is dropped, and the same prompt again loads from the pool — a restarted instance's load path
without the restart (``pool-restart-one-process-*.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hwkv.bench import results_dir
from hwkv.bench.common import machine, model_dir, write_result

CHILD = r"""
import json, sys, time
import hwkv
from hwkv import SamplingParams
cfg = json.loads(sys.argv[1])
kw = dict(backend=cfg["backend"], dtype=cfg["dtype"], block_size=cfg["block_size"], max_model_len=cfg["max_len"],
          num_kv_blocks=cfg["blocks"], **cfg["engine_args"])
if cfg["pool"] is not None:
    kw.update(kv_connector="pool", kv_connector_config=cfg["pool"])
e = hwkv.Engine(cfg["model"], **kw)
sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
def timing():
    st = e.stats().get("kv_connector") or {}
    return {k: v for k, v in st.items() if k.startswith(("load_", "put_", "lookup")) and k.endswith(("_s", "_jobs"))}
e.generate([cfg["warm"]], sp, use_tqdm=False)
before = timing()  # the warm request's own loads (the fill put its chunks too) are not the measured one's
t0 = time.perf_counter()
out = e.generate([cfg["prompt"]], sp, use_tqdm=False)[0]
ttft = time.perf_counter() - t0
if cfg["pool"] is not None:
    conn, deadline = e.connector, time.monotonic() + 120
    while conn.has_pending_transfers() and time.monotonic() < deadline:
        e.step()
        time.sleep(0.001)
st = e.stats().get("kv_connector") or {}
timing = {k: round(v - before.get(k, 0.0), 6) for k, v in timing().items()}
print("RESULT " + json.dumps({"ttft_s": ttft, "tokens": out.token_ids, "loaded_bytes": st.get("loaded_bytes", 0),
                               "stored_chunks": st.get("stored_chunks", 0),
                               "lookup_hit_tokens": st.get("lookup_hit_tokens", 0),
                               "failed_loads": st.get("failed_loads", 0), "timing": timing}), flush=True)
e.close()
"""

# --one-process: one engine start per --via instead of four in all (an 8B start takes ~40 s). The engine
# recomputes the prompt (its lookup misses: the prefix is new to the pool), its chunks reach the
# pool, its device prefix cache is dropped, and the same prompt again loads from the pool: what a
# restarted instance does, without the restart.
CHILD_ONE = r"""
import json, os, sys, time
import hwkv
from hwkv import SamplingParams
cfg = json.loads(sys.argv[1])
kw = dict(backend=cfg["backend"], dtype=cfg["dtype"], block_size=cfg["block_size"], max_model_len=cfg["max_len"],
          num_kv_blocks=cfg["blocks"], kv_connector="pool", kv_connector_config=cfg["pool"], **cfg["engine_args"])
t_start = time.perf_counter()
e = hwkv.Engine(cfg["model"], **kw)
start_s = time.perf_counter() - t_start
sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
def settle(reset):
    deadline = time.monotonic() + 120
    while e.connector.has_pending_transfers() and time.monotonic() < deadline:
        e.step()
        time.sleep(0.001)
    assert not e.connector.has_pending_transfers(), "pool transfers still pending after 120 s"
    assert not reset or e.kv_cache_manager.reset_prefix_cache(), "prefix cache reset refused: blocks still held"
def timing():
    st = e.stats().get("kv_connector") or {}
    return {k: v for k, v in st.items() if k.startswith(("load_", "put_", "lookup")) and k.endswith(("_s", "_jobs"))}
res = {}
# hit: the prompt again with its blocks still in the device prefix cache (no load): the floor of a
# load's TTFT, and the reference for its tokens where both reuse the same number of prompt tokens
for name, prompt in (("warm", cfg["warm"]), ("warm_load", cfg["warm"]), ("none", cfg["prompt"]),
                     ("hit", cfg["prompt"]), ("pool", cfg["prompt"])):
    settle(reset=name != "hit")
    before = timing()
    t0 = time.perf_counter()
    out = e.generate([prompt], sp, use_tqdm=False)[0]
    ttft = time.perf_counter() - t0
    st = e.stats().get("kv_connector") or {}
    res[name] = {"ttft_s": ttft, "tokens": out.token_ids, "loaded_bytes": st.get("loaded_bytes", 0),
                 "cached_tokens": out.metrics.num_cached_tokens if out.metrics is not None else None,
                 "timing": {k: round(v - before.get(k, 0.0), 6) for k, v in timing().items()}}
res["packed_loads"] = (e.stats().get("kv_connector") or {}).get("packed_loads")
res["engine_start_s"] = start_s
# A/B in this process: the same load with other load_parallel values (best of two rounds each)
ab = {}
# "hKpP" (several holders): K holders' load in the same engine - another prompt whose chunks were all
# put on the first K holders (in turn), its device-cache hit as the reference, then its load (P calls per client)
refs = {}
for _ in range(2):
    for n in cfg.get("ab_parallel", []):  # "P": P calls on one client; "cK" / "cKpP": K clients (P calls each);
        # "rP": several holders, each value through its holder's clients (routed loads make one call per client
        # whatever P); the others do not route
        # a trailing "s": the GIL switch interval at 0.2 ms during the load (its threads take turns with the engine's);
        # "o": staging -> device copies as one launch per KV tensor (HWKV_CUDA_COPY_LAUNCH=tensor, before one launch);
        # "k": every block through copy_blocks, no memcpy per run (HWKV_POOL_LAND_MEMCPY=0)
        # "#K" at the end: a repeat under a name of its own (the same setting, its own best of two)
        n0, n = n, n.partition("#")[0]
        flags = set(n[1:]) & {"s", "o", "k"}
        n = n.rstrip("sok")
        hk = int(n[1:].partition("p")[0]) if n.startswith("h") else 0
        lanes, _, par = n[1:].partition("p") if n.startswith(("c", "h")) else ("1", "", n.lstrip("r"))
        prompt = cfg["prompt"]
        if hk:
            prompt = list(prompt)
            prompt[0] = prompt[0] - hk if prompt[0] > hk else prompt[0] + hk  # every chunk's chain hash differs
        for t in e.connector.worker.transfers:
            t.load_parallel, t.lanes_active = int(par or 1), 1 if hk else int(lanes)
            t.routed = (hk > 0 or n.startswith("r")) and bool(t.segments and t.locate)
        if hk and hk not in refs:
            ring = [(t, t._holder_ring) for t in e.connector.worker.transfers]
            for t, _ in ring:
                t._holder_ring = t._holder_ring[:hk]
            settle(reset=True)
            e.generate([prompt], sp, use_tqdm=False)  # recomputed; its chunks go to the first hk holders
            settle(reset=False)
            for t, r0 in ring:
                t._holder_ring = r0
            refs[hk] = e.generate([prompt], sp, use_tqdm=False)[0].token_ids  # a device-cache hit
        settle(reset=True)
        before = timing()
        switch = sys.getswitchinterval()
        if "s" in flags:
            sys.setswitchinterval(0.0002)
        launch, memcpy = os.environ.get("HWKV_CUDA_COPY_LAUNCH"), os.environ.get("HWKV_POOL_LAND_MEMCPY")
        if "o" in flags:
            os.environ["HWKV_CUDA_COPY_LAUNCH"] = "tensor"
        if "k" in flags:
            os.environ["HWKV_POOL_LAND_MEMCPY"] = "0"
        t0 = time.perf_counter()
        out = e.generate([prompt], sp, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        sys.setswitchinterval(switch)
        for k, was in (("HWKV_CUDA_COPY_LAUNCH", launch), ("HWKV_POOL_LAND_MEMCPY", memcpy)):
            if was is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = was
        r = {"ttft_s": ttft, "tokens": out.token_ids, "ref_tokens": refs.get(hk),
             "cached_tokens": out.metrics.num_cached_tokens if out.metrics is not None else None,
             "timing": {k: round(v - before.get(k, 0.0), 6) for k, v in timing().items()}}
        seen = ab.get(n0, {}).get("rounds", [])  # every load of this setting: (TTFT, tokens, reused tokens)
        if n0 not in ab or ttft < ab[n0]["ttft_s"]:
            ab[n0] = r
        ab[n0]["rounds"] = seen + [[ttft, r["tokens"], r["cached_tokens"]]]
res["ab_parallel"] = ab
print("RESULT " + json.dumps(res), flush=True)
e.close()
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, a shape of `hwkv bench e2e` (llama-1b, ...) or a HF dir")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None, help="default float32 on cpu, else bfloat16")
    p.add_argument("--prompt-len", type=int, default=8192, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--capacity-mb", type=int, default=2048, help="each holder's memory")
    p.add_argument("--holders", type=int, default=1, help="memory holders (as `hwkv pool master --holders`); "
                   "with several, --via holder reads each value through the holder that has it")
    p.add_argument("--via", default="holder,tcp", help="pool clients to measure: holder (shared memory with the "
                   "holder on this host) and/or tcp")
    p.add_argument("--staging-mb", type=int, default=64, help="the pool connector's staging_bytes (per direction)")
    p.add_argument("--chunk-size", type=int, default=None, help="the pool connector's chunk_size in tokens (a "
                   "multiple of --block-size; default one block): the tokens of one pool value")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per variant (best TTFT kept)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per engine process")
    p.add_argument("--pool-config", default="{}", help="JSON dict merged into the pool connector's config "
                   "(every pool engine), e.g. '{\"pack\": true}'")
    p.add_argument("--one-process", action="store_true", help="one engine process per --via: recompute, then "
                   "drop the device prefix cache and load the same prompt from the pool (no fill, no restart)")
    p.add_argument("--ab-parallel", default="", help="--one-process: after the measured load, the same load again "
                   "with each of these settings (comma-separated; best of two each), same process: P = load_parallel "
                   "P on one client, cK = spread over K of the load_clients, cKpP = both")
    p.add_argument("--holder-threads", type=int, default=8, help="the holder's service threads")
    p.add_argument("--engine-args", default="{}", help="JSON dict of extra Engine kwargs (every process)")
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--out-dir", default=None)


def _child(cfg: dict[str, Any], timeout_s: float, code: str = CHILD) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], capture_output=True, text=True,
                       timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"engine process failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(line[7:])


def _summary(runs: dict[str, list[dict[str, Any]]], errors: dict[str, str], fill: dict[str, Any]) -> dict[str, Any]:
    best = {k: min(r["ttft_s"] for r in v) for k, v in runs.items() if v}
    out: dict[str, Any] = {"ttft_recompute_ms": 1e3 * best["none"], "runs": runs,
                           "filled_chunks": fill["stored_chunks"], "tokens_identical": True, "errors": errors,
                           "speedup": None}
    for name in runs:
        if name != "none" and name in best:
            v = name[5:]
            out[f"ttft_pool_{v}_ms"] = 1e3 * best[name]
            out[f"speedup_{v}"] = best["none"] / best[name]
            out["speedup"] = out["speedup"] or out[f"speedup_{v}"]
    return out


def run(args: argparse.Namespace) -> int:
    import random

    from hwkv.bench.serve import _commit
    from hwkv.stores.mooncake_service import mooncake_available, mooncake_holder, mooncake_master

    ok, why = mooncake_available()
    if not ok:
        print(f"hwkv bench pool-restart: mooncake is needed ({why})", file=sys.stderr)
        return 2
    if args.dtype is None:
        args.dtype = "float32" if args.backend == "cpu" else "bfloat16"
    if not 1 <= args.holders <= 64:
        print(f"hwkv bench pool-restart: --holders={args.holders} is invalid (allowed: 1..64)", file=sys.stderr)
        return 2
    via = [v.strip() for v in args.via.split(",") if v.strip()]
    if not via or set(via) - {"holder", "tcp"}:
        print(f"hwkv bench pool-restart: --via={args.via!r} is invalid (allowed: holder, tcp, or both)",
              file=sys.stderr)
        return 2
    mdir = str(model_dir(args))
    mcfg = json.loads((Path(mdir) / "config.json").read_text())
    vocab, model_max = mcfg.get("vocab_size", 512), mcfg.get("max_position_embeddings")
    need = args.prompt_len + args.suffix_len + 2 * args.block_size
    if model_max is not None and need > model_max:
        print(f"hwkv bench pool-restart: --prompt-len {args.prompt_len} + --suffix-len {args.suffix_len} + two "
              f"blocks = {need} tokens exceed the model's {model_max} (allowed: --prompt-len <= "
              f"{model_max - args.suffix_len - 2 * args.block_size})", file=sys.stderr)
        return 2
    rng = random.Random(0)
    prefix = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
    suffix = [[rng.randrange(1, vocab) for _ in range(args.suffix_len)] for _ in range(2 + args.repeats)]
    max_len = args.prompt_len + args.suffix_len + 2 * args.block_size
    warm_prefix = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
    warm = [warm_prefix + [rng.randrange(1, vocab) for _ in range(args.suffix_len)] for _ in range(2 + args.repeats)]
    base = dict(model=mdir, backend=args.backend, dtype=args.dtype, block_size=args.block_size, max_len=max_len,
                blocks=2 * (max_len // args.block_size + 2), engine_args=json.loads(args.engine_args), warm=warm[0])
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        m = stack.enter_context(mooncake_master())
        hs = [stack.enter_context(mooncake_holder(m, args.capacity_mb << 20, timeout_s=60.0,
                                                  threads=args.holder_threads)) for _ in range(args.holders)]
        tcp = dict(store="mooncake", master=m.master, metadata_server=m.metadata_server, protocol="tcp",
                   global_segment_size=0, staging_bytes=args.staging_mb << 20)
        if args.chunk_size is not None:
            tcp["chunk_size"] = args.chunk_size
        tcp.update(json.loads(args.pool_config))
        local = {"holder": f"127.0.0.1:{hs[0].port}"} if len(hs) == 1 else \
            {"holders": {f"127.0.0.1:{h.port}": h.segment for h in hs}}
        pools = {"holder": {**tcp, **local}, "tcp": tcp}
        if args.one_process:
            return _one_process(args, base, pools, via, prefix + suffix[1])
        # the fill puts the warm-up prefix too: each measured process's warm-up loads it (another suffix)
        fill = _child({**base, "pool": pools[via[0]], "prompt": prefix + suffix[0]}, args.timeout)
        print(f"fill ({via[0]}): {fill['stored_chunks']} chunks put, process exited", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {"none": [], **{f"pool-{v}": [] for v in via}}
        errors: dict[str, str] = {}
        day = dt.date.today().isoformat()
        name = f"pool-restart-{Path(args.model).name}-{args.backend}-{day}.json"  # a model path: its last part
        path = Path(args.out_dir or results_dir()) / name
        for i in range(args.repeats):
            prompt = prefix + suffix[1 + i]
            for name in runs:
                pool = pools.get(name[5:])  # load-only: every variant finds what the fill put, no more
                try:
                    cfg = {**base, "pool": pool and {**pool, "save": False}, "prompt": prompt, "warm": warm[1 + i]}
                    r = _child(cfg, args.timeout)
                except (RuntimeError, subprocess.TimeoutExpired) as e:  # the other variants still run
                    errors[name] = str(e)[-2000:]
                    print(f"  {name:>11}: FAILED {errors[name]}", flush=True)
                    if name == "none":
                        raise
                    continue
                runs[name].append(r)
                tm = r.get("timing") or {}
                split = "" if not tm.get("load_jobs") else (
                    f" (get: store calls {1e3 * tm['load_store_s']:.1f} ms, waiting for device copies "
                    f"{1e3 * tm['load_copy_wait_s']:.1f} ms, compute-stream event {1e3 * tm['load_event_s']:.1f} ms,"
                    f" whole get {1e3 * tm['load_wall_s']:.1f} ms in {tm['load_jobs']:.0f} job(s); lookup "
                    f"{1e3 * tm.get('lookup_s', 0):.1f} ms; the rest of the TTFT (scheduling, the suffix's prefill) "
                    f"{1e3 * (r['ttft_s'] - tm['load_wall_s'] - tm.get('lookup_s', 0)):.1f} ms)")
                print(f"  {name:>11}: TTFT {1e3 * r['ttft_s']:.1f} ms, loaded {r['loaded_bytes']} B{split}", flush=True)
                if r["tokens"] != runs["none"][-1]["tokens"]:
                    raise RuntimeError(f"tokens differ with {name}: {r['tokens']} vs {runs['none'][-1]['tokens']}")
                out = _summary(runs, errors, fill)
                # after every run: a bench cut short by its time limit keeps what finished
                write_result(path, {"bench": "pool-restart", "date": day, "machine": machine(),
                                    "commit": os.environ.get("HWKV_COMMIT") or _commit(),
                                    "command": "hwkv bench pool-restart " + " ".join(sys.argv[3:]),
                                    "args": vars(args), "results": out})
    for v in via:
        if f"speedup_{v}" in out:
            print(f"cold restart, first request of a {args.prompt_len}-token shared prefix: TTFT "
                  f"{out[f'ttft_pool_{v}_ms']:.1f} ms from the persistent pool ({v}) vs "
                  f"{out['ttft_recompute_ms']:.1f} ms recomputed = x{out[f'speedup_{v}']:.2f} (goal >= 4)", flush=True)
    return 1 if out.get("errors") else 0


def _one_process(args: argparse.Namespace, base: dict[str, Any], pools: dict[str, Any], via: list[str],
                 prompt: list[int]) -> int:
    """``--one-process``: per ``--via`` one engine recomputes ``prompt`` and then loads it from the pool."""
    from hwkv.bench.serve import _commit

    day = dt.date.today().isoformat()
    name = f"pool-restart-one-process-{Path(args.model).name}-{args.backend}-{day}.json"
    path = Path(args.out_dir or results_dir()) / name
    out: dict[str, Any] = {}
    failed = False
    for n, v in enumerate(via):
        # a prompt of its own per variant: the earlier variant's chunks must not be a hit here
        p = prompt if n == 0 else [(t + 7 * n) % (max(prompt) + 1) or 1 for t in prompt]
        try:
            ab = [x.strip() for x in args.ab_parallel.split(",") if x.strip()]
            r = _child({**base, "pool": pools[v], "prompt": p, "ab_parallel": ab}, args.timeout, CHILD_ONE)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            out[v] = {"error": str(e)[-2000:]}
            failed = True
            print(f"  {v}: FAILED {out[v]['error']}", flush=True)
            continue
        # The pool's KV is the recompute's, byte for byte (put by it); its tokens must equal a device-cache
        # hit's that reuses as many prompt tokens (the same kernels then compute the same tail). Against
        # the recompute (the whole prompt in one forward) a greedy token may flip between near-equal
        # logits (random weights): reported, not an error.
        # (A prompt of k x chunk_size + 1 tokens makes both reuse k chunks.)
        same_split = r["pool"]["cached_tokens"] == r["hit"]["cached_tokens"]
        ref = "hit" if same_split else "none"
        none, pool, tm = r["none"]["ttft_s"], r["pool"]["ttft_s"], r["pool"]["timing"]
        out[v] = {"ttft_recompute_ms": 1e3 * none, "ttft_pool_ms": 1e3 * pool, "speedup": none / pool,
                  "ttft_device_hit_ms": 1e3 * r["hit"]["ttft_s"], "tokens_checked_against": ref,
                  "tokens_equal_recompute": r["pool"]["tokens"] == r["none"]["tokens"],
                  "packed_loads": r.pop("packed_loads", None),
                  "loaded_bytes": r["pool"]["loaded_bytes"] - r["none"]["loaded_bytes"], "runs": r}
        if r["pool"]["tokens"] != r[ref]["tokens"]:  # the figures are kept; the run fails
            out[v]["error"] = (f"tokens differ with the pool ({v}): {r['pool']['tokens']} vs {r[ref]['tokens']} of the "
                               f"{'device-cache hit' if same_split else 'recompute'} ({r['pool']['cached_tokens']} vs "
                               f"{r[ref]['cached_tokens']} prompt tokens reused)")
            failed = True
            print(f"  {v}: FAILED {out[v]['error']}", flush=True)
        print(f"  {v}: recompute {1e3 * none:.1f} ms, from the pool {1e3 * pool:.1f} ms = x{none / pool:.2f} "
              f"(device-cache hit {1e3 * r['hit']['ttft_s']:.1f} ms; tokens checked against the "
              f"{'hit' if same_split else 'recompute'}, equal to the recompute's: {out[v]['tokens_equal_recompute']}) "
              f"(goal >= 4); load: store calls {1e3 * tm.get('load_store_s', 0):.1f} ms, waiting for device copies "
              f"{1e3 * tm.get('load_copy_wait_s', 0):.1f} ms, whole get {1e3 * tm.get('load_wall_s', 0):.1f} ms, "
              f"lookup {1e3 * tm.get('lookup_s', 0):.1f} ms, queueing device copies "
              f"{1e3 * tm.get('load_land_s', 0):.1f} ms, locate {1e3 * tm.get('load_locate_s', 0):.1f} ms; "
              f"loads through their values' holders "
              f"{tm.get('load_routed_jobs', 0):.0f} of {tm.get('load_jobs', 0):.0f}"
              f"{'; packed' if out[v]['packed_loads'] else ''}; engine start {r.get('engine_start_s', 0):.1f} s",
              flush=True)
        for n, a in r.get("ab_parallel", {}).items():
            at = a["timing"]
            rounds = a.get("rounds") or [[a["ttft_s"], a["tokens"], a["cached_tokens"]]]
            want = a.get("ref_tokens") or r[ref]["tokens"]
            ok = all(t == want and c == r["pool"]["cached_tokens"] for _, t, c in rounds)  # every load, not the best
            out[v].setdefault("ab_parallel", {})[n] = {"ttft_ms": 1e3 * a["ttft_s"], "speedup": none / a["ttft_s"],
                                                      "rounds_ms": [round(1e3 * x, 2) for x, _, _ in rounds],
                                                      "load_store_ms": 1e3 * at.get("load_store_s", 0),
                                                      "load_wall_ms": 1e3 * at.get("load_wall_s", 0),
                                                      "tokens_equal": ok}
            every = "/".join(f"{1e3 * x:.1f}" for x, _, _ in rounds)
            print(f"    {n}: from the pool {1e3 * a['ttft_s']:.1f} ms = x{none / a['ttft_s']:.2f} (loads {every} ms = "
                  f"x{'/x'.join(f'{none / x:.2f}' for x, _, _ in rounds)})"
                  f"{' (only the first ' + n[1:].split('p')[0] + ' holder(s) have its chunks)' if n[0] == 'h' else ''}"
                  f"; store "
                  f"calls {1e3 * at.get('load_store_s', 0):.1f} ms, copy wait {1e3 * at.get('load_copy_wait_s', 0):.1f}"
                  f" ms, copy queueing {1e3 * at.get('load_land_s', 0):.1f} ms, whole get "
                  f"{1e3 * at.get('load_wall_s', 0):.1f} ms; tokens as the reference: {ok}", flush=True)
            if not ok:
                failed = True
                out[v]["error"] = f"{n}: tokens or reused tokens differ from the reference"
        write_result(path, {"bench": "pool-restart --one-process", "date": day, "machine": machine(),
                            "commit": os.environ.get("HWKV_COMMIT") or _commit(),
                            "command": "hwkv bench pool-restart " + " ".join(sys.argv[3:]), "args": vars(args),
                            "results": out})
    return 1 if failed else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m hwkv.bench.pool_restart", description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))

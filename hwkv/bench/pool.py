"""``hwkv bench pool``: what the global KV pool buys and costs.

* TTFT of a long prompt on an engine that loads its KV from the pool (put there by another engine)
  vs on the engine that computed it — same prompt, same tokens (checked);
* put and get GB/s through the connector's sending/receiving threads (zero-copy on host KV, host
  staging on an accelerator), lookup latency per 1k prompt tokens through the ZMQ bridge.

Embedded store by default; ``--store mooncake`` uses ``--master`` or starts a local mooncake_master.
Results: ``pool-<model>-<device>-<date>.json`` under ``--out-dir`` (default the bench results dir).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import hwkv
from hwkv import SamplingParams
from hwkv.bench import results_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, a shape of `hwkv bench e2e` (llama-1b, qwen-0.5b) "
                   "or a local HF dir")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None, help="default float32 on cpu, else bfloat16")
    p.add_argument("--prompt-len", type=int, default=2048, help="prompt tokens (8192 on a GPU)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per pool entry (default the block size)")
    p.add_argument("--store", choices=("embedded", "mooncake"), default="embedded")
    p.add_argument("--master", default=None, help="mooncake: host:port (default: start a local master)")
    p.add_argument("--metadata-server", default=None, help="mooncake: metadata URL (with --master)")
    p.add_argument("--segment-mb", type=int, default=1024, help="mooncake: memory each engine contributes "
                   "(the pool must hold the prompts' KV twice: put for TTFT, then fresh keys for put GB/s)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lookup-iters", type=int, default=200)
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--engine-args", default="{}", help="JSON dict of extra Engine kwargs")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--settle-timeout", type=float, default=120.0, help="seconds to wait for the first engine's "
                   "puts to land in the pool before the second engine's measured run")


def _settle(eng: Any, timeout_s: float = 120.0) -> float:
    """Step the idle engine until its pool transfers completed (on an accelerator the sending thread
    waits for the forward's event and puts through host staging after ``generate`` returned);
    seconds waited."""
    conn, t0 = eng.scheduler.connector, time.monotonic()
    while conn.has_pending_transfers():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"pool transfers did not complete in {timeout_s:.0f} s: {_why(eng)}")
        eng.step()
        time.sleep(0.001)
    return time.monotonic() - t0


def _in_pool(eng: Any, hashes: list[bytes], timeout_s: float) -> float:
    """Wait (bounded) until ``eng``'s lookup sees all ``hashes`` in the pool; seconds waited."""
    client, t0 = eng.scheduler.connector.scheduler.client, time.monotonic()
    while (n := client.lookup(hashes)) < len(hashes):
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"pool bench: only {n} of the prompt's {len(hashes)} chunks are in the pool "
                               f"{timeout_s:.0f} s after the first engine's run: {_why(eng)}")
        time.sleep(0.01)
    return time.monotonic() - t0


_WHY = ("stored_chunks", "failed_stores", "last_store_error", "lookups", "lookup_timeouts", "lookup_errors",
        "lookup_last_error", "load_jobs", "failed_loads", "load_timeouts", "last_load_error", "load_failures",
        "store_up", "store_last_error")


def _why(*engines: Any) -> str:
    """The connector counters that say why a bench run did not hit (for the error message)."""
    parts = []
    for e in engines:
        st = e.stats()["kv_connector"]
        parts.append("{" + ", ".join(f"{k}={st[k]!r}" for k in _WHY if k in st) + "}")
    return " / ".join(parts)


def _ttft(eng: Any, prompt: list[int]) -> tuple[float, list[int]]:
    eng.backend.device.synchronize()
    t0 = time.perf_counter()
    out = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    return time.perf_counter() - t0, out.token_ids


def _wait(transfer: Any, job_id: int, timeout_s: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in transfer.drain():
            if d.job_id == job_id:
                return d
        time.sleep(0.0002)
    raise RuntimeError("bench transfer did not complete in time")


def _throughput(eng: Any, hashes: list[bytes]) -> dict[str, float]:
    """Put (fresh keys) and get (the prompt's keys) of the prompt's chunks through the connector's
    threads, into/from the engine's first blocks (the engine is not used afterwards)."""
    from hwkv.connectors.pool.transfer import GetJob, PutJob

    sched, worker = eng.scheduler.connector.scheduler, eng.scheduler.connector.worker
    cb, tr, key = sched.chunk_blocks, worker.transfer, worker.key
    chunks = [list(range(i * cb, (i + 1) * cb)) for i in range(len(hashes))]
    nbytes = len(hashes) * sched._chunk_bytes
    done = eng.backend.device.new_event()
    done.record()
    t0 = time.perf_counter()
    tr.submit_put(PutJob(-1, key.keys([os.urandom(32) for _ in hashes]), chunks, done))
    put = _wait(tr, -1)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    tr.submit_get(GetJob(-2, "bench", key.keys(hashes), chunks, done))
    get = _wait(tr, -2)
    t_get = time.perf_counter() - t0
    if not (put.ok and get.ok and put.nbytes == nbytes):
        raise RuntimeError(f"bench put/get failed ({put.nbytes} of {nbytes} bytes put; a full pool? raise "
                           f"--segment-mb): {put.error or get.error}")
    return {"bytes": nbytes, "put_GBps": nbytes / t_put / 1e9, "get_GBps": nbytes / t_get / 1e9,
            "put_ms": t_put * 1e3, "get_ms": t_get * 1e3}


def _lookup(eng: Any, hashes: list[bytes], iters: int) -> float:
    client = eng.scheduler.connector.scheduler.client
    assert client.lookup(hashes) == len(hashes), "the prompt's chunks must be in the pool"
    t0 = time.perf_counter()
    for _ in range(iters):
        client.lookup(hashes)
    return (time.perf_counter() - t0) / iters * 1e3


def run(args: argparse.Namespace) -> int:
    from hwkv.core.hashing import hash_token_blocks

    dtype = args.dtype or ("float32" if args.backend == "cpu" else "bfloat16")
    if args.prompt_len < 2 * args.block_size:
        raise SystemExit(f"hwkv bench pool: --prompt-len must be >= {2 * args.block_size}")
    from hwkv.bench.common import model_dir

    mdir = str(model_dir(argparse.Namespace(**{**vars(args), "dtype": dtype})))
    with contextlib.ExitStack() as stack:
        cfg: dict[str, Any] = {"store": args.store, "chunk_size": args.chunk_size}
        if args.store == "embedded":
            cfg.update(store_name=f"bench-{os.getpid()}", capacity_bytes=8 << 30)
        else:
            master, meta = args.master, args.metadata_server
            if master is None:
                from hwkv.stores.mooncake_service import mooncake_master

                m = stack.enter_context(mooncake_master())
                master, meta = m.master, m.metadata_server
            cfg.update(master=master, metadata_server=meta or "P2PHANDSHAKE", protocol="tcp",
                       global_segment_size=args.segment_mb << 20)
        max_len = args.prompt_len + args.block_size
        kw = dict(backend=args.backend, dtype=dtype, block_size=args.block_size, max_model_len=max_len,
                  num_kv_blocks=2 * (max_len // args.block_size + 2), kv_connector="pool", kv_connector_config=cfg)
        kw.update(json.loads(args.engine_args))
        a, b = hwkv.Engine(mdir, **kw), hwkv.Engine(mdir, **kw)
        for e in (a, b):
            stack.callback(e.scheduler.connector.shutdown)
        rng = random.Random(0)
        vocab = a.vocab_size
        conn = b.scheduler.connector.scheduler
        cs = conn.chunk_blocks * conn.block_size
        n_chunks = (args.prompt_len - 1) // cs
        warm = [rng.randrange(1, vocab) for _ in range(4 * args.block_size + 1)]
        for e in (a, b):  # first-call costs (allocations, graphs) out of the timings
            _ttft(e, warm)
            _settle(e)
        recompute, pooled, store_wait = [], [], []
        for _ in range(args.repeats):
            prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
            hashes = hash_token_blocks(prompt, args.block_size)[conn.chunk_blocks - 1::conn.chunk_blocks][:n_chunks]
            t, toks = _ttft(a, prompt)
            recompute.append(t)
            # the measured load must find every chunk: wait for a's pending puts (bounded), then check
            store_wait.append(_settle(a, args.settle_timeout))
            store_wait[-1] += _in_pool(b, hashes, max(1.0, args.settle_timeout - store_wait[-1]))
            hits = b.stats()["kv_connector"]["external_hit_tokens"]
            t, toks_b = _ttft(b, prompt)
            pooled.append(t)
            _settle(b, args.settle_timeout)
            got = b.stats()["kv_connector"]["external_hit_tokens"] - hits
            if toks_b != toks or got != n_chunks * cs:
                raise RuntimeError(f"pool bench: loaded run differs (tokens {toks} vs {toks_b}, hit tokens {got} "
                                   f"of {n_chunks * cs}); first engine / second engine: {_why(a, b)}")
        lookup_ms = _lookup(b, hashes, args.lookup_iters)
        thr = _throughput(b, hashes)
        st = b.stats()["kv_connector"]
    med = statistics.median
    res = {
        "model": Path(mdir).name, "backend": args.backend, "device": a.backend.device.name, "dtype": dtype,
        "store": args.store, "prompt_len": args.prompt_len, "chunk_size": cs, "loaded_tokens": n_chunks * cs,
        "ttft_recompute_ms": med(recompute) * 1e3, "ttft_pool_ms": med(pooled) * 1e3,
        "speedup": med(recompute) / med(pooled), "store_wait_ms": max(store_wait) * 1e3,
        "lookup_ms": lookup_ms, "lookup_ms_per_1k_tokens": lookup_ms / (n_chunks * cs / 1000),
        **thr, "load_failures": st["load_failures"], "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d"),
    }
    out_dir = Path(args.out_dir) if args.out_dir else results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"pool-{res['model']}-{args.backend}-{args.store}-c{cs}-{res['date']}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"pool bench ({args.backend}, {args.store}, {args.prompt_len} tokens, chunk {cs}): "
          f"TTFT recompute {res['ttft_recompute_ms']:.1f} ms, from pool {res['ttft_pool_ms']:.1f} ms "
          f"({res['speedup']:.2f}x); put {res['put_GBps']:.2f} GB/s, get {res['get_GBps']:.2f} GB/s "
          f"({thr['bytes'] / 1e6:.1f} MB); lookup {lookup_ms:.3f} ms ({res['lookup_ms_per_1k_tokens']:.3f} ms "
          f"per 1k tokens); waited {res['store_wait_ms']:.1f} ms for the puts -> {path}")
    return 0

"""`hwkv bench cache`: prefix-cache hot paths on the CPU (also `python -m hwkv.bench.cache`).

* hash: sha256 chain per 16-token block, engine path (a 32k-token prompt through ``make_block_hasher``)
* alloc+free: ``BlockPool.get_new_blocks`` + ``free_blocks`` per block, batches of 16
* lookup: ``get_computed_blocks`` on a 32k-token prompt, full hit and full miss (hashes precomputed,
  as in the engine, where a request is hashed once when it arrives)
* decode step: the cache manager's share of a scheduler step with 256 running decodes — per request
  ``allocate_slots(req, 1)`` (block growth + registering newly full blocks) and appending the sampled
  token (which hashes a block whenever one fills)
* ``--dup-traces N``: the duplicate-caching policy question. A block computed with a hash that is
  already cached (two requests prefilling one prefix at once, a recompute behind an evicted chain
  head) stays uncached in hwkv; vLLM registers it as a second copy so evicting one copy keeps the
  prefix. N random scheduler traces (shared system prompts, multi-turn follow-ups, memory pressure,
  chunked prefill, preemption; no model) run with both pools; prefix-hit and computed tokens compared

Median of repeats. vLLM peer figures are quoted (vLLM 0.33 v1 core, same 2-core machine class), not
re-measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from hwkv.bench import results_dir

PEER = {  # vLLM 0.33.0 v1 core, measured on this machine class; quoted, not re-measured
    "hash_us_per_block": 1.85,
    "alloc_free_us_per_block": 0.45,
    "lookup_full_hit_us": 1270.0,
    "lookup_full_miss_us": 25.0,
    "step_decodes_ms": 3.1,  # whole scheduler step (schedule + update_from_output)
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-running", type=int, default=256, help="running decodes in the step bench")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", default=None, help="JSON path (default <results_dir>/cache-cpu-<date>.json)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--dup-traces", type=int, default=0, help="also compare duplicate caching on N random traces")


def _median_time(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_hash(args: argparse.Namespace, rng: random.Random) -> dict:
    from hwkv.core.hashing import make_block_hasher
    from hwkv.core.request import Request

    hasher = make_block_hasher(args.block_size)
    req = Request("h", [rng.randrange(150_000) for _ in range(args.prompt_tokens)])
    nblocks = args.prompt_tokens // args.block_size

    def run() -> None:
        req.block_hashes = []
        req.block_hashes.extend(hasher(req))

    t = _median_time(run, args.repeats)
    assert len(req.block_hashes) == nblocks
    return {"hash_us_per_block": t / nblocks * 1e6, "hash_prompt_ms": t * 1e3}


def bench_alloc_free(args: argparse.Namespace) -> dict:
    from hwkv.core.block_pool import BlockPool

    pool = BlockPool(4096)
    batch, iters = 16, 2000

    def run() -> None:
        get, free = pool.get_new_blocks, pool.free_blocks
        for _ in range(iters):
            free(reversed(get(batch)))

    t = _median_time(run, args.repeats)
    assert pool.num_free_blocks == 4096
    return {"alloc_free_us_per_block": t / (iters * batch) * 1e6}


def bench_lookup(args: argparse.Namespace, rng: random.Random) -> dict:
    from hwkv.core.hashing import make_block_hasher
    from hwkv.core.kv_cache_manager import KVCacheManager
    from hwkv.core.request import Request

    bs, n = args.block_size, args.prompt_tokens
    hasher = make_block_hasher(bs)
    m = KVCacheManager(n // bs + 64, bs)
    prompt = [rng.randrange(150_000) for _ in range(n)]
    owner = Request("owner", prompt, block_hasher=hasher)
    assert m.allocate_slots(owner, n) is not None
    hit_req = Request("hit", prompt, block_hasher=hasher)
    miss_req = Request("miss", [prompt[0] + 1] + prompt[1:], block_hasher=hasher)
    assert m.get_computed_blocks(hit_req)[1] == (n - 1) // bs * bs
    assert m.get_computed_blocks(miss_req) == ([], 0)
    reps = max(args.repeats, 50)
    hit = _median_time(lambda: m.get_computed_blocks(hit_req), reps)
    miss = _median_time(lambda: m.get_computed_blocks(miss_req), reps)
    miss_with_hash = _median_time(
        lambda: m.get_computed_blocks(Request("m", miss_req.prompt_token_ids, block_hasher=hasher)), args.repeats
    )
    m.free(owner)
    return {
        "lookup_full_hit_us": hit * 1e6,
        "lookup_full_miss_us": miss * 1e6,
        "lookup_full_miss_incl_request_hashing_us": miss_with_hash * 1e6,
    }


def bench_decode_step(args: argparse.Namespace, rng: random.Random) -> dict:
    from hwkv.core.hashing import make_block_hasher
    from hwkv.core.kv_cache_manager import KVCacheManager
    from hwkv.core.request import Request

    bs, nreq, steps, prompt_len = args.block_size, args.num_running, 64, 500
    hasher = make_block_hasher(bs)
    per_step = []
    for _ in range(max(3, args.repeats // 3)):
        m = KVCacheManager(nreq * ((prompt_len + steps) // bs + 2), bs)
        reqs = []
        for i in range(nreq):
            r = Request(f"r{i}", [rng.randrange(150_000) for _ in range(prompt_len)], block_hasher=hasher)
            assert m.allocate_slots(r, r.num_tokens) is not None
            r.num_computed_tokens = r.num_tokens
            reqs.append(r)
        cached0 = len(m.block_pool.cached_block_hash_to_block)
        toks = [rng.randrange(150_000) for _ in range(steps)]
        t0 = time.perf_counter()
        for s in range(steps):
            tok = toks[s]
            for r in reqs:
                r.append_output_token_ids(tok)  # sampled token of the previous step
                m.allocate_slots(r, 1)
                r.num_computed_tokens += 1
        per_step.append((time.perf_counter() - t0) / steps)
        assert len(m.block_pool.cached_block_hash_to_block) - cached0 == nreq * ((prompt_len + steps) // bs - 31)
        for r in reqs:
            m.free(r)
        assert m.num_free_blocks == m.block_pool.num_blocks
    return {"step_decodes_ms": statistics.median(per_step) * 1e3}


class DupBlockPool:
    """vLLM's duplicate policy over hwkv's pool, for the comparison only: a second block with a cached
    hash is registered too; the lookup returns the oldest copy; evicting one copy keeps the others."""

    def __new__(cls, num_blocks: int, enable_caching: bool = True):  # a BlockPool with three methods swapped
        from hwkv.core.block_pool import BlockPool

        pool = BlockPool(num_blocks, enable_caching)
        copies: dict[bytes, list] = {}  # hash -> duplicate blocks after the primary

        def cache_full_blocks(request, blocks, num_cached, num_full):  # noqa: ANN001
            cached, hashes = pool.cached_block_hash_to_block, request.block_hashes
            for i in range(num_cached, num_full):
                b, h = blocks[i], hashes[i]
                if b.block_hash is not None:
                    continue
                b.block_hash = h
                if h in cached:
                    copies.setdefault(h, []).append(b)
                else:
                    cached[h] = b

        def get_new_blocks(n):  # noqa: ANN001
            ret = pool.free_block_queue.popleft_n(n)
            cached = pool.cached_block_hash_to_block
            for b in ret:
                h = b.block_hash
                if h is not None:
                    rest = copies.get(h)
                    if cached.get(h) is b:
                        if rest:
                            cached[h] = rest.pop(0)
                        else:
                            del cached[h]
                            pool.stats.evictions += 1
                    else:
                        rest.remove(b)
                    if rest is not None and not rest:
                        del copies[h]
                    b.block_hash = None
                b.ref_cnt = 1
            return ret

        pool.cache_full_blocks, pool.get_new_blocks = cache_full_blocks, get_new_blocks
        return pool


def _next_tok(seq: list[int]) -> int:
    """The fake model: the next token is a function of the last three, so a repeated context repeats."""
    return 5000 + (seq[-1] * 31 + seq[-2] * 7 + seq[-3]) % 997 if len(seq) >= 3 else 5000


def _trace(rng: random.Random) -> dict:
    systems = [[rng.randrange(100, 4000) for _ in range(rng.randint(8, 24))] for _ in range(rng.randint(1, 3))]
    reqs: list[tuple[list[int], int, int]] = []  # prompt, max_tokens, arrival step
    for _ in range(rng.randint(10, 30)):
        if reqs and rng.random() < 0.3:  # a follow-up turn: an earlier conversation and its answer, plus more
            prompt, m, a = rng.choice(reqs)
            seq = list(prompt)
            for _ in range(m):
                seq.append(_next_tok(seq))
            reqs.append((seq + [rng.randrange(100, 4000) for _ in range(rng.randint(2, 8))], rng.randint(1, 12),
                         a + rng.randint(1, 15)))
            continue
        pre = rng.choice(systems) if rng.random() < 0.8 else []
        reqs.append((pre + [rng.randrange(100, 4000) for _ in range(rng.randint(2, 20))], rng.randint(1, 16),
                     rng.randint(0, 30)))
    cfg = dict(max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.randint(8, 64),
               max_num_partial_prefills=rng.randint(1, 3), max_model_len=256)
    longest = max(len(p) + m for p, m, _ in reqs)
    return dict(reqs=reqs, cfg=cfg, blocks=rng.randint(-(-longest // 4) + 1, 48))


def _simulate(trace: dict, dup: bool) -> dict:
    from types import SimpleNamespace

    from hwkv.core.hashing import make_block_hasher
    from hwkv.core.kv_cache_manager import KVCacheManager
    from hwkv.core.request import Request
    from hwkv.core.sched_output import ModelRunnerOutput
    from hwkv.core.scheduler import Scheduler, SchedulerConfig

    kv = KVCacheManager(trace["blocks"], 4)
    if dup:
        kv.block_pool = DupBlockPool(trace["blocks"])
    s = Scheduler(SchedulerConfig(**trace["cfg"]), kv)
    hasher, sp = make_block_hasher(4), SimpleNamespace(stop_token_ids=None, ignore_eos=True)
    todo = sorted(enumerate(trace["reqs"]), key=lambda x: x[1][2])
    step = computed = 0
    while (todo or s.has_unfinished_requests()) and step < 5000:
        while todo and todo[0][1][2] <= step:
            i, (p, m, _) = todo.pop(0)
            s.add_request(Request(f"r{i}", list(p), sp, block_hasher=hasher, max_tokens=m))
        so = s.schedule()
        computed += so.total_num_scheduled_tokens
        sampled = {rid: [_next_tok(r.all_token_ids)] for rid in so.num_scheduled_tokens
                   if (r := s.requests[rid]).num_computed_tokens == r.num_tokens}
        s.update_from_output(so, ModelRunnerOutput(sampled))
        step += 1
    assert not s.has_unfinished_requests() and kv.num_free_blocks == trace["blocks"]
    return dict(hits=kv.stats.hits, queries=kv.stats.queries, computed=computed, steps=step,
                preemptions=s.num_preemptions)


def bench_duplicates(args: argparse.Namespace) -> dict:
    rng = random.Random(1)
    tot = {k: {"hits": 0, "queries": 0, "computed": 0, "steps": 0, "preemptions": 0} for k in ("hwkv", "vllm_dup")}
    more = fewer = 0
    for _ in range(args.dup_traces):
        t = _trace(rng)
        a, b = _simulate(t, False), _simulate(t, True)
        for k, r in (("hwkv", a), ("vllm_dup", b)):
            for m in r:
                tot[k][m] += r[m]
        more += b["hits"] > a["hits"]
        fewer += b["hits"] < a["hits"]
    return {"traces": args.dup_traces, "totals": tot, "traces_dup_hits_more": more, "traces_dup_hits_fewer": fewer}


def _program() -> str:
    prog = Path(sys.argv[0]).name
    if prog in ("cli.py", "__main__.py"):
        return "hwkv"
    return "python -m hwkv.bench.cache" if prog in ("cache.py", "-m", "-c", "") else prog


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m": os.getloadavg()[0],  # the machine is shared: context for the timings
    }


ROWS = [
    ("sha256 block hash (µs / 16-token block)", "hash_us_per_block", "≤ 1.0"),
    ("alloc+free (µs / block, batches of 16)", "alloc_free_us_per_block", ""),
    ("get_computed_blocks 32k full hit (µs)", "lookup_full_hit_us", ""),
    ("get_computed_blocks 32k full miss (µs)", "lookup_full_miss_us", "< 5000"),
    ("  miss incl. hashing the new request (µs)", "lookup_full_miss_incl_request_hashing_us", ""),
    ("cache-manager share of a step, {n} decodes (ms)", "step_decodes_ms", ""),
]


def run(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    res: dict = {}
    res.update(bench_hash(args, rng))
    res.update(bench_alloc_free(args))
    res.update(bench_lookup(args, rng))
    res.update(bench_decode_step(args, rng))

    print(f"{'metric':<50} {'hwkv':>10} {'peer*':>10} {'bar':>8}")
    for label, key, bar in ROWS:
        peer = PEER.get(key)
        label = label.format(n=args.num_running)
        print(f"{label:<50} {res[key]:>10.3f} {'' if peer is None else f'{peer:.2f}':>10} {bar:>8}")
    print("* peer: vLLM 0.33 v1 core, same machine class — quoted, not re-measured;")
    print("  its step figure is a whole scheduler step, ours the cache-manager share of one.")
    dups = bench_duplicates(args) if args.dup_traces else None
    if dups is not None:
        a, b = dups["totals"]["hwkv"], dups["totals"]["vllm_dup"]
        print(f"\nduplicate caching, {dups['traces']} random traces: prefix-hit tokens {a['hits']} (hwkv: duplicates "
              f"stay uncached) vs {b['hits']} (vLLM: duplicates cached, {b['hits'] / a['hits'] - 1:+.2%}); computed "
              f"tokens {a['computed']} vs {b['computed']}; traces with more / fewer hits: "
              f"{dups['traces_dup_hits_more']} / {dups['traces_dup_hits_fewer']}")

    if not args.no_write:
        now = datetime.now(timezone.utc)
        out = Path(args.out or results_dir() / f"cache-cpu-{now:%Y-%m-%d}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "bench": "cache",
            "date": now.isoformat(timespec="seconds"),
            "command": " ".join([_program(), *sys.argv[1:]]),
            "machine": machine_info(),
            "params": {k: v for k, v in vars(args).items() if k not in ("func", "out")},
            "results": res,
            "peer_vllm_0_33_quoted": PEER,
            "bar": {"hash_us_per_block": 1.0, "lookup_full_miss_us": 5000.0},
        }
        if dups is not None:
            doc["duplicates"] = dups
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(prog="hwkv bench cache", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())

"""``hwkv bench routing``: cache-aware routing vs round-robin over several ``hwkv serve`` instances,
same run, same instances, same workload shape.

Workload (multi-tenant): ``--tenants`` system prompts of ``--system-len`` tokens (a range), each
request one tenant's system prompt (chosen at random) plus a unique ``--suffix-len``-token suffix,
``--requests`` of them with at most ``--concurrency`` in flight, streamed (TTFT = send -> first
token). Each instance's KV pool is ``--kv-share`` x its share of the tenants' prefixes (total
prefix tokens / instances): what it needs to keep its own tenants, not everyone's.

For each policy (``--policies``, default ``round_robin,cache_aware``) a router
(``hwkv proxy --instances ... --policy P``) is started in front of the same instances, which publish
KV events; every policy gets fresh tenant prompts (another seed, same lengths and request
sequence), so what an earlier phase cached never matches and is simply evicted. Reported per
policy: TTFT p50/p99/mean, the prefix-cache hit rate of the instances (their Prometheus counters:
hit tokens / prompt tokens during the phase), throughput, where the router sent requests.

``--devices 0,1``: instance i sees only device ``devices[i % len]`` (CUDA_VISIBLE_DEVICES).
Results: ``routing-<model>-<backend>-<date>.json`` under ``--out-dir`` (default the bench results dir).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hwkv.bench import results_dir
from hwkv.bench.common import machine, model_dir, wait_http, write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny, a shape of `hwkv bench e2e` (llama-1b, ...) or a HF dir")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--dtype", default=None, help="default float32 on cpu, else bfloat16")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--devices", default=None, help="comma-separated device indices, instance i gets devices[i]")
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--system-len", default="2048-8192", help="system prompt tokens, MIN-MAX (uniform)")
    p.add_argument("--suffix-len", type=int, default=64, help="unique tokens after the system prompt")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-share", type=float, default=1.25, help="each instance's KV pool, in multiples of its "
                   "share of the tenants' prefix tokens")
    p.add_argument("--policies", default="round_robin,cache_aware", help="router policies, one phase each; "
                   "cache_aware:W sets its --load-weight W (e.g. round_robin,cache_aware,cache_aware:1)")
    p.add_argument("--engine-args", default="", help="extra `hwkv serve` flags, one string")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--workdir", default="/tmp/hwkv-bench-models")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--seed", type=int, default=0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """A child process (``hwkv serve`` / ``hwkv proxy``) with its log; ``stop()`` always reaps it."""

    def __init__(self, cmd: list[str], env: dict[str, str], name: str):
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"hwkv-bench-{name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def tail(self, n: int = 40) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        from hwkv.bench.common import stop_process

        stop_process(self.proc, 20.0)
        self.log.close()
        os.unlink(self.log.name)


def _metric(url: str, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith(name + "_created") and " " in line:
            head = line.split("{", 1)[0].split(" ", 1)[0]
            if head in (name, name + "_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _one(http: Any, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    ttft, err, where = None, None, None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            where = r.headers.get("x-hwkv-instance")
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    data = json.loads(line[6:])
                    if "error" in data:
                        err = str(data["error"])[:300]
                        break
                    if ttft is None and (data.get("choices") or [{}])[0].get("text") is not None:
                        ttft = time.perf_counter() - t0
    except Exception as e:  # a failed request is counted, not a crashed bench
        err = f"{type(e).__name__}: {e}"
    if err is not None or ttft is None:
        return {"ok": False, "error": err or "no tokens"}
    return {"ok": True, "ttft": ttft, "e2e": time.perf_counter() - t0, "instance": where}


async def _drive(url: str, work: list[list[int]], args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    import httpx

    sem = asyncio.Semaphore(args.concurrency)
    timeout = httpx.Timeout(connect=30.0, read=600.0, write=60.0, pool=None)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as http:
        async def limited(prompt: list[int]) -> dict[str, Any]:
            async with sem:
                return await _one(http, url, prompt, args.max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in work))
        return results, time.perf_counter() - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] * 1e3 if xs else float("nan")


def _workloads(args: argparse.Namespace, vocab: int, phases: int) -> list[list[list[int]]]:
    """One request list per phase: the same lengths and tenant sequence, different tokens."""
    lo, hi = (int(x) for x in args.system_len.split("-"))
    shape = random.Random(args.seed)
    lens = [shape.randint(lo, hi) for _ in range(args.tenants)]
    seq = [(shape.randrange(args.tenants), args.suffix_len) for _ in range(args.requests)]
    out = []
    for ph in range(phases):
        rng = random.Random(1000 + 7919 * ph + args.seed)
        systems = [[rng.randrange(1, vocab) for _ in range(n)] for n in lens]
        out.append([systems[t] + [rng.randrange(1, vocab) for _ in range(s)] for t, s in seq])
    return out


def run(args: argparse.Namespace) -> int:
    import httpx

    if args.dtype is None:
        args.dtype = "float32" if args.backend == "cpu" else "bfloat16"
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    mdir = model_dir(args)
    vocab = json.loads((Path(mdir) / "config.json").read_text()).get("vocab_size", 512)
    lo, hi = (int(x) for x in args.system_len.split("-"))
    work = _workloads(args, vocab, len(policies))
    prefix_tokens = sum({tuple(p[:-args.suffix_len]): len(p) - args.suffix_len for p in work[0]}.values())
    blocks = int(args.kv_share * prefix_tokens / args.instances / args.block_size) + 1
    max_len = hi + args.suffix_len + args.max_tokens + args.block_size
    blocks = max(blocks, 2 * -(-max_len // args.block_size))  # at least two of the longest requests
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"routing bench: {args.instances} instances of {args.model} on {args.backend}, {args.tenants} tenants of "
          f"{lo}-{hi} tokens (+{args.suffix_len}), {args.requests} requests x {len(policies)} policies, "
          f"concurrency {args.concurrency}; KV {blocks} blocks of {args.block_size} per instance "
          f"({args.kv_share}x its share of {prefix_tokens} prefix tokens)", flush=True)
    procs: list[_Proc] = []
    results: dict[str, Any] = {}
    try:
        urls, events, replays, inst = [], [], [], []
        for i in range(args.instances):
            port, ev, rp = _port(), f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
            e = dict(env)
            if devices:
                e["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
            cmd = [sys.executable, "-m", "hwkv", "serve", "--model", str(mdir), "--backend", args.backend,
                   "--dtype", args.dtype, "--port", str(port), "--served-model-name", "m", "--num-kv-blocks",
                   str(blocks), "--block-size", str(args.block_size), "--max-model-len", str(max_len),
                   "--kv-events-endpoint", ev, "--kv-events-replay-endpoint", rp, "--log-level", "warning",
                   *args.engine_args.split()]
            inst.append(_Proc(cmd, e, f"serve{i}"))
            procs.append(inst[-1])
            urls.append(f"http://127.0.0.1:{port}")
            events.append(ev)
            replays.append(rp)
        t0 = time.monotonic()
        for p, u in zip(inst, urls):  # started together, waited for in turn
            if not wait_http(p.proc, u + "/health", max(1.0, args.start_timeout - (time.monotonic() - t0))):
                raise RuntimeError(f"{p.name} did not start:\n{p.tail()}")
        print(f"instances up in {time.monotonic() - t0:.1f} s", flush=True)
        for u in urls:  # warm-up, direct: first-request costs (compilation, graphs) are no policy's
            httpx.post(u + "/v1/completions", json={"model": "m", "prompt": [1] * 64, "max_tokens": 2},
                       timeout=600).raise_for_status()
        # the floor, one request at a time straight to instance 0: a longest-tenant-sized prompt (a miss),
        # then the same prefix with another suffix (a device-cache hit); what each policy's TTFT adds to these
        # is queueing and contention
        rng = random.Random(args.seed + 1)
        head = [rng.randrange(1, vocab) for _ in range(hi)]
        isolated = {}
        for name in ("miss", "hit"):
            r = asyncio.run(_drive(urls[0], [head + [rng.randrange(1, vocab) for _ in range(args.suffix_len)]],
                                   argparse.Namespace(concurrency=1, max_tokens=args.max_tokens)))[0][0]
            isolated[f"{name}_ttft_ms"] = 1e3 * r["ttft"] if r["ok"] else None
        miss, hit = (isolated[k] or float("nan") for k in ("miss_ttft_ms", "hit_ttft_ms"))
        print(f"one request alone on instance 0, {hi} + {args.suffix_len} tokens: TTFT miss {miss:.1f} ms, "
              f"hit {hit:.1f} ms", flush=True)
        for ph, policy in enumerate(policies):
            port = _port()
            name, _, weight = policy.partition(":")
            router = _Proc([sys.executable, "-m", "hwkv", "proxy", "--instances", ",".join(urls), "--kv-events",
                            ",".join(events), "--kv-events-replay", ",".join(replays), "--policy", name,
                            *(["--load-weight", weight] if weight else []),
                            "--port", str(port), "--log-level", "warning"], env, f"router-{name}")
            procs.append(router)
            rurl = f"http://127.0.0.1:{port}"
            if not wait_http(router.proc, rurl + "/v1/models", 60):
                raise RuntimeError(f"router did not start:\n{router.tail()}")
            before = [(_metric(u, "hwkv_prefix_cache_hits"), _metric(u, "hwkv_prefix_cache_queries")) for u in urls]
            res, dur = asyncio.run(_drive(rurl, work[ph], args))
            after = [(_metric(u, "hwkv_prefix_cache_hits"), _metric(u, "hwkv_prefix_cache_queries")) for u in urls]
            stats = httpx.get(rurl + "/router/stats", timeout=10).json()
            router.stop()
            procs.remove(router)
            ok = [r for r in res if r["ok"]]
            hits = sum(a[0] - b[0] for a, b in zip(after, before))
            queries = sum(a[1] - b[1] for a, b in zip(after, before))
            ttft = [r["ttft"] for r in ok]
            results[policy] = {
                "completed": len(ok), "failed": len(res) - len(ok),
                "errors": sorted({r["error"] for r in res if not r["ok"]})[:5],
                "duration_s": dur, "request_throughput": len(ok) / dur,
                "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
                "ttft_mean_ms": 1e3 * sum(ttft) / max(1, len(ttft)),
                "prefix_hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits, "prompt_tokens": queries,
                "per_instance_hit_rate": [(a[0] - b[0]) / max(1.0, a[1] - b[1]) for a, b in zip(after, before)],
                "routed": [x["routed"] for x in stats["instances"]],
                "router_matched_fraction": stats["matched_fraction"],
            }
            r = results[policy]
            print(f"{policy:>12}: TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms  "
                  f"hit rate {100 * r['prefix_hit_rate']:5.1f}%  {r['request_throughput']:6.2f} req/s  "
                  f"routed {r['routed']}  failed {r['failed']}", flush=True)
    finally:
        for p in reversed(procs):
            p.stop()
    vs_rr: dict[str, dict[str, float | None]] = {}
    for name, ca in results.items():
        if "round_robin" not in results or not name.startswith("cache_aware"):
            continue
        rr = results["round_robin"]
        hit = ca["prefix_hit_rate"] / rr["prefix_hit_rate"] if rr["prefix_hit_rate"] else None
        r = vs_rr[name] = {"hit_rate_x": hit,
                           "ttft_p50_x": rr["ttft_p50_ms"] / ca["ttft_p50_ms"] if ca["ttft_p50_ms"] else None,
                           "ttft_p99_x": rr["ttft_p99_ms"] / ca["ttft_p99_ms"] if ca["ttft_p99_ms"] else None}
        print(f"{name} vs round_robin: hit rate x{r['hit_rate_x'] or 0:.2f} (goal >= 2), TTFT p50 "
              f"x{r['ttft_p50_x'] or 0:.2f} better (goal >= 2), p99 x{r['ttft_p99_x'] or 0:.2f}")
    ratios = vs_rr.get("cache_aware", {})
    day = dt.date.today().isoformat()
    out = Path(args.out_dir or results_dir()) / f"routing-{args.model}-{args.backend}-x{args.instances}-{day}.json"
    cmd = "hwkv bench routing " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "routing"] else sys.argv[1:])
    from hwkv.bench.serve import _commit

    write_result(out, {"bench": "routing", "date": day, "machine": machine(), "command": cmd,
                       "commit": os.environ.get("HWKV_COMMIT") or _commit(),
                       "args": vars(args), "kv_blocks_per_instance": blocks, "prefix_tokens": prefix_tokens,
                       "isolated": isolated,
                       "results": results, "cache_aware_vs_round_robin": ratios, "vs_round_robin": vs_rr})
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m hwkv.bench.routing", description=__doc__.splitlines()[0])
    add_arguments(p)
    raise SystemExit(run(p.parse_args()))

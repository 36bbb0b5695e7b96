"""``hwkv bench NAME [ARGS...]``: the core's benchmarks (``hwkv.bench.<name>``) plus those plugins
provide through their ``hwkv_benches`` hook (the CUDA backend's ``attention``).

Each bench module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only
when chosen, so one bench whose dependencies are missing does not break the others.
"""

from __future__ import annotations

import argparse
import sys

BENCHES = {
    "cache": ("hwkv.bench.cache", "prefix cache: block hashing, block pool, get_computed_blocks"),
    "scheduler": ("hwkv.bench.scheduler", "scheduler step latency (decodes, mixed chunked prefill)"),
    "admission": ("hwkv.bench.admission", "first-chunk vs whole-prompt admission under memory pressure "
                  "(throughput, preemptions, TTFT)"),
    "e2e": ("hwkv.bench.e2e", "end-to-end engine throughput vs HF transformers generate"),
    "cpu": ("hwkv.bench.cpu", "the demo's real model (SmolLM2-135M GGUF) on the CPU reference backend vs HF "
            "transformers generate, same weights and threads; --profile: top torch ops"),
    "defaults": ("hwkv.bench.defaults", "the public API with default arguments: offline throughput and batch-1 "
                 "MBU against the roofline, every non-default argument printed"),
    "kv-dtype": ("hwkv.bench.kv_dtype", "fp8 vs model-dtype KV cache: decode step at long context, pool capacity, "
                 "greedy agreement, bytes per block"),
    "host": ("hwkv.bench.host", "engine host overhead per decode step (stub forward, emulated graphs)"),
    "offload": ("hwkv.bench.offload", "CPU offload connector: device<->host KV copy GB/s, TTFT of a host-tier "
                "hit vs recompute, decode throughput with the connector on vs off"),
    "spec": ("hwkv.bench.spec", "speculative decoding: decode speedup vs non-speculative (n-gram, draft = target, "
             "1-layer draft), acceptance"),
    "pool-restart": ("hwkv.bench.pool_restart", "persistent pool: TTFT of a restarted engine's first "
                     "shared-prefix request, loaded from the pool vs recomputed (real mooncake master + holder)"),
    "routing": ("hwkv.bench.routing", "cache-aware routing vs round-robin over several hwkv serve instances "
                "(multi-tenant shared system prompts): TTFT p50/p99 and prefix hit rate, same run"),
    "pool": ("hwkv.bench.pool", "global KV pool: TTFT loaded from the pool vs recomputed, put/get "
             "GB/s, lookup latency"),
    "serve": ("hwkv.bench.serve", "online serving: Poisson arrivals against an OpenAI-compatible server "
              "(TTFT, ITL, throughput)"),
    "structured": ("hwkv.bench.structured", "structured outputs: json_schema vs free generation throughput, same "
                   "engine and batch (llguidance bitmask cost)"),
    "pd": ("hwkv.bench.pd", "prefill/decode disaggregation (p2p connector + proxy) vs one colocated engine: "
           "TTFT, ITL, transfer GB/s"),
    "transfer": ("hwkv.bench.transfer", "one-sided writes between two processes: device-direct (cuda_ipc, cma) vs "
                 "tcp staging vs the in-process peer-copy limit, GB/s by size and segment count"),
    "tp": ("hwkv.bench.tp", "tensor parallelism vs one device, same run: batch-1 decode, offline throughput, MBU "
           "per GPU, greedy tokens under the conformance margin rule (CUDA, 2+ GPUs)"),
}


def benches() -> dict[str, tuple[str, str]]:
    """name -> (module, description): the core's, then the plugins' (a core name is never shadowed)."""
    from hwkv.plugins import list_benches

    out = dict(BENCHES)
    for spec in list_benches():
        out.setdefault(spec.name, (spec.module, spec.description))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bench", metavar="NAME",
                        help="; ".join(f"{k}: {d}" for k, (_, d) in BENCHES.items())
                        + "; plus the benches installed backends provide (e.g. attention, from cuda)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of that bench (see --help)")


def run(args: argparse.Namespace) -> int:
    from hwkv.cli import load_command, missing_extra

    name, known = args.bench, benches()
    if name not in known:
        print(f"hwkv bench: unknown bench {name!r} (allowed: {', '.join(sorted(known))}; a backend's own "
              "benches need its plugin installed or named in HWKV_PLUGIN_MODULES)", file=sys.stderr)
        return 2
    module, description = known[name]
    if (why := missing_extra(f"bench {name}")) is not None:
        print(f"hwkv bench: {why}", file=sys.stderr)
        return 2
    try:
        mod = load_command(module, f"bench {name!r}")
    except RuntimeError as e:
        print(f"hwkv bench: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"hwkv bench {name}", description=description)
    mod.add_arguments(parser)
    return int(mod.run(parser.parse_args(args.bench_args)) or 0)

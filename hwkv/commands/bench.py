"""``hwkv bench {cache,scheduler,attention,e2e,serve} [ARGS...]``: dispatch to ``hwkv.bench.<name>``.

Each bench module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is imported only
when chosen, so one bench whose dependencies are missing does not break the others.
"""

from __future__ import annotations

import argparse
import sys

BENCHES = {
    "cache": "prefix cache: block hashing, block pool, get_computed_blocks",
    "scheduler": "scheduler step latency (decodes, mixed chunked prefill)",
    "attention": "attention kernels vs torch SDPA / FlexAttention",
    "e2e": "end-to-end engine throughput vs HF transformers generate",
    "serve": "online serving: Poisson arrivals against an OpenAI-compatible server (TTFT, ITL, throughput)",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bench", choices=list(BENCHES), metavar="{" + ",".join(BENCHES) + "}",
                        help="; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of that bench (see --help)")


def run(args: argparse.Namespace) -> int:
    from hwkv.cli import load_command

    name = args.bench
    try:
        mod = load_command(f"hwkv.bench.{name}", f"bench {name!r}")
    except RuntimeError as e:
        print(f"hwkv bench: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"hwkv bench {name}", description=BENCHES[name])
    mod.add_arguments(parser)
    return int(mod.run(parser.parse_args(args.bench_args)) or 0)

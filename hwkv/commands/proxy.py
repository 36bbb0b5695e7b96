"""``hwkv proxy``: one OpenAI-compatible endpoint in front of several servers, in one of two modes.

* ``--prefill URL[,URL...] --decode URL[,URL...]``: the disaggregated-serving proxy
  (:mod:`hwkv.serving.proxy`): prefill on one server, decode on another, KV moved by the p2p
  connector; round-robin over each side's servers.
* ``--instances URL[,URL...] --kv-events tcp://...[,...] --model DIR``: the cache-aware router
  (:mod:`hwkv.serving.router`): each request goes to the instance caching the longest prefix of its
  prompt, as the instances' KV events tell, with load balance and a least-loaded fallback
  (``--policy round_robin | least_loaded`` for baselines).

Streaming is passed through in both."""

from __future__ import annotations

import argparse
import sys


def _urls(s: str) -> list[str]:
    urls = [u.strip() for u in s.split(",") if u.strip()]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if not urls or bad:
        raise argparse.ArgumentTypeError(f"expected comma-separated http(s):// URLs, got {s!r}")
    return urls


def _addrs(s: str) -> list[str]:
    out = [a.strip() for a in s.split(",") if a.strip()]
    if not out or not all(a.rpartition(":")[2].isdigit() and a.rpartition(":")[0] for a in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated HOST:PORT, got {s!r}")
    return out


def _endpoints(s: str) -> list[str]:
    out = [a.strip() for a in s.split(",") if a.strip()]
    if not out or not all(a.startswith(("tcp://", "ipc://")) for a in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated ZMQ endpoints (tcp://HOST:PORT), got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", default=None, type=_urls, help="prefill server URL(s), comma-separated "
                   "(hwkv serve --kv-connector p2p --kv-connector-config '{\"role\": \"producer\"}')")
    p.add_argument("--decode", default=None, type=_urls, help="decode server URL(s), comma-separated "
                   "(role 'consumer', same mode as the prefill servers)")
    p.add_argument("--layerwise", action="store_true", help="consumer-first flow: decode servers announce "
                   "their blocks to the prefill servers, which (with layerwise=true) push each layer as it is "
                   "computed; needs --prefill-side-channel")
    p.add_argument("--prefill-side-channel", type=_addrs, default=None, help="with --layerwise: each prefill "
                   "server's p2p side channel HOST:PORT (its side_channel_port), comma-separated, in --prefill order")
    r = p.add_argument_group("cache-aware router (instead of --prefill/--decode; docs/routing.md)")
    r.add_argument("--instances", type=_urls, default=None, help="instance URLs (hwkv serve of one model), "
                   "comma-separated")
    r.add_argument("--kv-events", type=_endpoints, default=None, help="each instance's --kv-events-endpoint, "
                   "comma-separated, in --instances order")
    r.add_argument("--kv-events-replay", type=_endpoints, default=None, help="each instance's "
                   "--kv-events-replay-endpoint (resync after missed events), in --instances order")
    r.add_argument("--model", default=None, help="the model directory (its tokenizer and chat template: the "
                   "router hashes prompts as the servers do)")
    r.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin", "least_loaded"])
    r.add_argument("--balance-abs", type=int, default=16, help="cache_aware: an instance with more than this "
                   "many requests in flight above the least loaded one is not a candidate")
    r.add_argument("--load-weight", type=float, default=0.0, help="cache_aware: > 0 weighs the prefix against "
                   "queued work: the instance with the fewest blocks to compute for this prompt plus this x the "
                   "blocks its in-flight requests had to compute wins (0: the longest cached prefix wins)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a backend server may take per request")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    if args.instances is not None:
        return _run_router(args, uvicorn)
    if args.prefill is None or args.decode is None:
        print("hwkv proxy: error: give --prefill and --decode (P/D proxy) or --instances (cache-aware router)",
              file=sys.stderr)
        return 2
    from hwkv.serving.proxy import build_proxy

    if args.layerwise != (args.prefill_side_channel is not None):
        print("hwkv proxy: error: --layerwise and --prefill-side-channel go together", file=sys.stderr)
        return 2
    try:
        app = build_proxy(args.prefill, args.decode, args.timeout, args.prefill_side_channel)
    except ValueError as e:
        print(f"hwkv proxy: error: {e}", file=sys.stderr)
        return 2
    print(f"hwkv proxy: prefill {', '.join(args.prefill)}; decode {', '.join(args.decode)}; "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def _run_router(args: argparse.Namespace, uvicorn) -> int:
    from hwkv.serving.router import Router, build_router

    if args.prefill or args.decode or args.layerwise:
        print("hwkv proxy: error: --instances (router) does not go with --prefill/--decode/--layerwise",
              file=sys.stderr)
        return 2
    tokenizer = None
    if args.model is not None:
        from hwkv.model.tokenizer import Tokenizer

        try:
            tokenizer = Tokenizer.from_dir(args.model)
        except Exception as e:
            print(f"hwkv proxy: error: --model {args.model}: {e}", file=sys.stderr)
            return 2
    elif args.policy == "cache_aware":
        print("hwkv proxy: warning: no --model: only prompts given as token ids are scored by cache; text "
              "prompts are routed least-loaded", file=sys.stderr)
    try:
        router = Router(args.instances, args.kv_events, args.kv_events_replay, policy=args.policy,
                        tokenizer=tokenizer, balance_abs=args.balance_abs, load_weight=args.load_weight)
    except ValueError as e:
        print(f"hwkv proxy: error: {e}", file=sys.stderr)
        return 2
    print(f"hwkv proxy: router ({args.policy}) over {', '.join(args.instances)}; http://{args.host}:{args.port}/v1",
          file=sys.stderr, flush=True)
    uvicorn.run(build_router(router, args.timeout), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0

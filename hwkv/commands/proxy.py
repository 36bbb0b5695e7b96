"""``hwkv proxy --prefill URL[,URL...] --decode URL[,URL...] --port P``: the disaggregated-serving
proxy (:mod:`hwkv.serving.proxy`): prefill on one server, decode on another, KV moved by the p2p
connector; OpenAI-compatible, streaming passed through, round-robin over each side's servers."""

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, type=_urls, help="prefill server URL(s), comma-separated "
                   "(hwkv serve --kv-connector p2p --kv-connector-config '{\"role\": \"producer\"}')")
    p.add_argument("--decode", required=True, type=_urls, help="decode server URL(s), comma-separated "
                   "(role 'consumer', same mode as the prefill servers)")
    p.add_argument("--layerwise", action="store_true", help="consumer-first flow: decode servers announce "
                   "their blocks to the prefill servers, which (with layerwise=true) push each layer as it is "
                   "computed; needs --prefill-side-channel")
    p.add_argument("--prefill-side-channel", type=_addrs, default=None, help="with --layerwise: each prefill "
                   "server's p2p side channel HOST:PORT (its side_channel_port), comma-separated, in --prefill order")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a backend server may take per request")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

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

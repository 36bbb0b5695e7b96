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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", required=True, type=_urls, help="prefill server URL(s), comma-separated "
                   "(hwkv serve --kv-connector p2p --kv-connector-config '{\"role\": \"producer\"}')")
    p.add_argument("--decode", required=True, type=_urls, help="decode server URL(s), comma-separated "
                   "(role 'consumer', same mode as the prefill servers)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a backend server may take per request")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from hwkv.serving.proxy import build_proxy

    app = build_proxy(args.prefill, args.decode, args.timeout)
    print(f"hwkv proxy: prefill {', '.join(args.prefill)}; decode {', '.join(args.decode)}; "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0

"""`hwkv serve`: the OpenAI-compatible HTTP server over an engine-core process.

Engine options are generated from :class:`hwkv.engine.EngineArgs`' fields, one flag per option
(``max_num_seqs`` → ``--max-num-seqs``; booleans get ``--x``/``--no-x``), so every Engine
knob is a flag and a new one appears without touching this file. ``kv_connector`` (an object in
the Engine) is ``--kv-connector NAME`` + ``--kv-connector-config JSON``, built in the core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any

HELP = {
    "backend": "hardware backend name (see `hwkv backends`)",
    "dtype": "float32 | bfloat16 | float16 | auto (default: the checkpoint's)",
    "num_kv_blocks": "KV cache blocks (default: --memory-fraction of free device memory)",
    "max_num_batched_tokens": "tokens per step (default: by device and entry point, docs/engine.md; "
                              "a server on a >= 70 GiB GPU: 8192)",
    "max_num_seqs": "running requests at once (default: by device, docs/engine.md: 1024 on a >= 70 GiB GPU, else 256)",
    "usage_context": "offline | server: the entry point the defaults are chosen for [default: server here]",
    "kv_cache_dtype": "auto | fp8 (float8 e4m3 KV cache, half the bytes; docs/fp8-kv-cache.md) [default: auto]",
    "kv_cache_scales": "fp8 KV scales as JSON: a float, [k, v], per layer [[k, v], ...] or per KV head [default: 1.0]",
    "scheduling_policy": "fcfs | priority (requests' `priority` field, lower first) [default: fcfs]",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_options() -> list[tuple[str, str, Any]]:
    """``(name, annotation, default)`` of every Engine option a flag can carry."""
    from dataclasses import MISSING, fields

    from hwkv.engine import EngineArgs

    skip = {"model", "kv_connector", "kv_connector_config"}  # their own flags below
    return [(f.name, str(f.type).replace(" ", ""), f.default)
            for f in fields(EngineArgs) if f.name not in skip and f.default is not MISSING]


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per Engine keyword argument, plus ``--kv-connector[-config]``."""
    g = p.add_argument_group("engine options (hwkv.Engine keyword arguments)")
    for name, t, default in engine_options():
        help_ = HELP.get(name) or f"Engine({name}=...) [default: {default}]"
        if t in ("bool", "bool|None"):
            g.add_argument(_flag(name), action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif t in ("int", "int|None"):
            g.add_argument(_flag(name), type=int, default=default, help=help_)
        elif t in ("float", "float|None"):
            g.add_argument(_flag(name), type=float, default=default, help=help_)
        else:  # str / Any (backend, dtype, scheduling_policy): by name
            g.add_argument(_flag(name), default=default, help=help_)
    g.add_argument("--kv-connector", default=None, help="KV connector: a registered name or 'package.module:Class'")
    g.add_argument("--kv-connector-config", default=None, type=_json_object,
                   help="JSON object of the connector's keyword arguments")


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``AsyncEngine`` keyword arguments from the parsed flags (engine options only)."""
    kw = {name: getattr(args, name) for name, _, _ in engine_options()}
    kw["kv_connector"] = args.kv_connector
    kw["kv_connector_config"] = args.kv_connector_config
    return kw


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("HWKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $HWKV_API_KEY; none: open)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the engine core")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(p)


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hwkv.serving import AsyncEngine, EngineDeadError
    from hwkv.serving.api_server import build_app
    from hwkv.serving.metrics import ServingMetrics

    name = args.served_model_name or args.model
    metrics = ServingMetrics(name)
    engine = AsyncEngine(args.model, metrics=metrics, startup_timeout=args.startup_timeout, **engine_kwargs(args))
    try:
        await engine.start()
    except (EngineDeadError, ValueError) as e:  # ValueError: ModelLoadError of an unreadable tokenizer.json
        print(f"hwkv serve: error: {e}", file=sys.stderr)
        return 1
    try:
        info = engine.info
        print(f"hwkv serve: {name} on {info.backend} ({info.device}), {info.num_kv_blocks} KV blocks x "
              f"{info.block_size}, max_model_len {info.max_model_len}; http://{args.host}:{args.port}/v1",
              file=sys.stderr, flush=True)
        app = build_app(engine, name, args.api_key, metrics)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=5)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
        # that was installed before it: a no-op here, so the engine core is shut down below too.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        await uvicorn.Server(config).serve()
    finally:
        await engine.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))

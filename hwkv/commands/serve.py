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
    "kv_events_endpoint": "publish KV-cache events on this ZMQ PUB address, e.g. tcp://127.0.0.1:5557 "
                          "(docs/kv-events.md) [default: off]",
    "kv_events_replay_endpoint": "serve missed KV-event batches on this ZMQ ROUTER address [default: none]",
}


# vLLM's spelling of an Engine option, accepted as the same flag
ALIASES = {"memory_fraction": ("--gpu-memory-utilization",), "tensor_parallel_size": ("-tp",)}


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
        flags = [_flag(name), *ALIASES.get(name, ())]
        if t in ("bool", "bool|None"):
            g.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif t in ("int", "int|None"):
            g.add_argument(*flags, type=int, default=default, help=help_)
        elif t in ("float", "float|None"):
            g.add_argument(*flags, type=float, default=default, help=help_)
        else:  # str / Any (backend, dtype, scheduling_policy): by name
            g.add_argument(*flags, default=default, help=help_)
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


# vLLM flags that hwkv spells differently or does not have: one line naming what to use instead
VLLM_HINTS = {
    "--kv-transfer-config": "hwkv: --kv-connector NAME --kv-connector-config JSON (`hwkv connectors` lists them; "
                            "P/D: --kv-connector p2p, see docs/disaggregation.md)",
    "--pipeline-parallel-size": "hwkv has no pipeline parallelism; use --tensor-parallel-size",
    "--quantization": "hwkv serves the checkpoint's dtype (--dtype); quantized weights are not supported",
    "--tokenizer": "hwkv reads tokenizer.json from the model directory",
    "--trust-remote-code": "hwkv runs its own model code (Llama, Qwen3, Qwen3-MoE); no remote code is loaded",
    "--swap-space": "hwkv preempts by recompute; CPU KV offload is --kv-connector offload",
    "--download-dir": "hwkv serves a local directory (no downloads)",
    "--revision": "hwkv serves a local directory (no downloads)",
}


class _Hint(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, ns: Any, values: Any, option: str | None = None) -> None:
        parser.error(f"{option} is a vLLM flag hwkv does not take; {VLLM_HINTS[self.dest_flag]}")

    def __init__(self, *a: Any, dest_flag: str = "", **k: Any):
        self.dest_flag = dest_flag
        super().__init__(*a, **k)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="local Hugging Face model directory (or --model)")
    p.add_argument("--model", default=None, help="local Hugging Face model directory")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model id(s) clients send (default: the model path; the first is listed and reported)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("HWKV_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $HWKV_API_KEY; none: open)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for the engine core")
    p.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--chat-template", default=None, help="a Jinja chat template (a file, or the template itself) "
                   "instead of the model's")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="parse tool calls from the model's text for tool_choice 'auto'")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM compatibility (tool_choice 'auto' needs --tool-call-parser)")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body (413 beyond) "
                   "[default: 32 MiB]")
    p.add_argument("--max-prompt-chars", type=int, default=None, help="longest prompt in characters, checked before "
                   "tokenizing (default: max_model_len x the longest token: no longer text can fit)")
    p.add_argument("--api-workers", type=int, default=4, help="threads that parse, validate and tokenize requests "
                   "off the event loop [default: 4]")
    p.add_argument("--health-deadline", type=float, default=20.0, help="/health answers 503 when the engine core "
                   "has been silent this long (it reports every second while it runs) [default: 20]")
    p.add_argument("--disable-log-requests", "--disable-log-stats", action="store_true",
                   help="accepted for vLLM compatibility (hwkv logs no requests)")
    for flag in VLLM_HINTS:
        p.add_argument(flag, nargs="?", action=_Hint, dest_flag=flag, help=argparse.SUPPRESS)
    add_engine_arguments(p)


GRACE_S = 5.0  # open requests get this long at SIGTERM; streams still open then end with an error event


def _model(args: argparse.Namespace) -> str | None:
    if args.model_tag and args.model and args.model_tag != args.model:
        return None
    return args.model_tag or args.model or None


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from hwkv.serving import AsyncEngine, EngineDeadError
    from hwkv.serving.api_server import ServingLimits, build_app
    from hwkv.serving.metrics import ServingMetrics

    model = _model(args)
    if model is None:
        print("hwkv serve: error: give the model (once): `hwkv serve MODEL` or `--model MODEL`", file=sys.stderr)
        return 2
    names = args.served_model_name or [model]
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    metrics = ServingMetrics(names[0])
    engine = AsyncEngine(model, metrics=metrics, startup_timeout=args.startup_timeout, **engine_kwargs(args))
    try:
        await engine.start()
    except (EngineDeadError, ValueError) as e:  # ValueError: ModelLoadError of an unreadable tokenizer.json
        print(f"hwkv serve: error: {e}", file=sys.stderr)
        return 1
    app = None
    try:
        if template is not None and engine.tokenizer is not None:
            engine.tokenizer.chat_template = template
        info = engine.info
        print(f"hwkv serve: {names[0]} on {info.backend} ({info.device}), {info.num_kv_blocks} KV blocks x "
              f"{info.block_size}, max_model_len {info.max_model_len}; http://{args.host}:{args.port}/v1",
              file=sys.stderr, flush=True)
        limits = ServingLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                               workers=args.api_workers, health_deadline_s=args.health_deadline)
        app = build_app(engine, names, args.api_key, metrics, limits, args.tool_call_parser)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, lifespan="off",
                                timeout_graceful_shutdown=GRACE_S)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal to the handler
        # that was installed before it: a no-op here, so the engine core is shut down below too.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        await _Server(config, engine).serve()
    finally:
        await engine.shutdown()
        if app is not None:
            app.state.pool.shutdown(wait=False, cancel_futures=True)
    return 0


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's, plus: requests still open shortly before the grace period ends are failed, so a
        stream ends with an error event and ``[DONE]`` (a waiting request gets a 503), not a cut connection."""

        def __init__(self, config: Any, engine: Any):
            super().__init__(config)
            self.engine = engine

        async def shutdown(self, sockets: Any = None) -> None:
            loop = asyncio.get_running_loop()
            cut = loop.call_later(max(GRACE_S - 1.0, 0.0), self.engine.fail_requests,
                                  f"the server is shutting down (requests still open after {GRACE_S - 1:g} s)")
            try:
                await super().shutdown(sockets)
            finally:
                cut.cancel()

    return Server


def _Server(config: Any, engine: Any) -> Any:  # noqa: N802 - a class built on first use (uvicorn is imported late)
    return _server_class()(config, engine)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(serve(args))

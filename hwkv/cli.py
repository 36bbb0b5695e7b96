"""The ``hwkv`` command. Subcommands live in their own modules, imported only when chosen, so a
command whose module (or its dependencies) cannot be imported fails alone with a clear message."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType

from hwkv import __version__

# name -> (module exposing add_arguments(parser) and run(args) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "backends": ("hwkv.commands.backends", "list installed backends, their availability and capabilities"),
    "connectors": ("hwkv.commands.connectors", "list KV connectors (Engine(kv_connector=NAME)) and their config"),
    "generate": ("hwkv.commands.generate", "generate text with a model on a backend"),
    "bench": ("hwkv.commands.bench", "benchmarks (cache, scheduler, e2e, serve, ...: hwkv bench --help)"),
    "conformance": ("hwkv.commands.conformance", "run the conformance suite against a backend"),
    "pool": ("hwkv.commands.pool", "global KV pool: run a local Mooncake master, print its counters"),
    "serve": ("hwkv.commands.serve", "OpenAI-compatible HTTP server (completions, chat, metrics)"),
    "proxy": ("hwkv.commands.proxy", "disaggregated-serving proxy: prefill and decode on separate servers"),
}


# command -> (pyproject extra, modules it needs): checked before the command's module is imported,
# so a missing extra is one line naming it, not a traceback from deep inside an import
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "serve": ("serve", ("fastapi", "uvicorn", "prometheus_client", "jinja2")),
    "proxy": ("serve", ("fastapi", "uvicorn", "httpx")),
    "conformance": ("conformance", ("pytest",)),
    "bench serve": ("serve", ("httpx",)),
    "bench pd": ("serve", ("fastapi", "uvicorn", "httpx")),
}


def missing_extra(command: str) -> str | None:
    """The one-line error for ``command`` when a module of its extra is not installed, else None."""
    import importlib.util

    if command not in EXTRAS:
        return None
    extra, modules = EXTRAS[command]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"`hwkv {command}` needs the '{extra}' extra (missing: {', '.join(missing)}): "
            f"pip install 'hwkv[{extra}]' (from a checkout: pip install -e '.[{extra}]')")


def load_command(module: str, what: str) -> ModuleType:
    """Import a command module; raise ``RuntimeError`` naming the command and the import error."""
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # ImportError, or anything its imports raise
        raise RuntimeError(f"{what} is unavailable: cannot import {module} ({type(e).__name__}: {e})") from e
    if not (callable(getattr(mod, "add_arguments", None)) and callable(getattr(mod, "run", None))):
        raise RuntimeError(f"{what} is unavailable: {module} lacks add_arguments(parser) and run(args)")
    return mod


def _chosen(argv: list[str]) -> str | None:
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hwkv", description="hwkv: hardware-abstracted LLM-inference backend SDK")
    parser.add_argument("--version", action="version", version=f"hwkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {name: sub.add_parser(name, help=h, description=h) for name, (_, h) in COMMANDS.items()}
    name = _chosen(argv)
    module = None
    if name in COMMANDS:
        if (why := missing_extra(name)) is not None:
            print(f"hwkv: {why}", file=sys.stderr)
            return 2
        try:
            module = load_command(COMMANDS[name][0], f"command {name!r}")
        except RuntimeError as e:
            print(f"hwkv: {e}", file=sys.stderr)
            return 2
        module.add_arguments(subparsers[name])
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(module.run(args) or 0)
    except BrokenPipeError:  # `hwkv backends | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())

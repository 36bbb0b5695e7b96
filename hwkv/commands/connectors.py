"""``hwkv connectors [--json]``: the KV connectors plugins register (``hwkv_connectors`` hook), each
with the plugin that provides it, what it does and its ``kv_connector_config`` keys."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of text")


def run(args: argparse.Namespace) -> int:
    from hwkv.plugins import list_connectors

    rows = [{"name": spec.name, "plugin": plugin, "factory": spec.factory, "description": spec.description,
             "config": dict(spec.config)} for spec, plugin in list_connectors()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['name']}  ({r['plugin']}: {r['factory']})")
        if r["description"]:
            print(f"    {r['description']}")
        for key, doc in r["config"].items():
            print(f"    config {key}: {doc}")
    print("\nUse: Engine(model, kv_connector=NAME, kv_connector_config={...}); "
          "hwkv serve --kv-connector NAME --kv-connector-config JSON")
    return 0

"""``hwkv backends [--json]``: installed backends, availability (with the reason and fix) and capabilities."""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    from hwkv.plugins import list_backends

    with warnings.catch_warnings(record=True) as caught:  # show plugin warnings with the listing
        warnings.simplefilter("always")
        infos = list_backends()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
    else:
        rows = [["NAME", "DISTRIBUTION", "VERSION", "AVAILABLE", "REASON", "CAPABILITIES"]]
        rows += [[i.name, i.dist, i.version, "yes" if i.available else "no", i.reason or "-", i.capabilities or "-"]
                 for i in infos]
        print(format_table(rows))
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return 0

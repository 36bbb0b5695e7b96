"""``hwkv backends [--json | --wide]``: installed backends, availability (with the reason and fix)
and capabilities. The table fits the terminal (``$COLUMNS``, else 100 columns when not a terminal):
the last column — the reason a backend is unavailable, else its capabilities — wraps under itself.
``--wide`` prints one line per backend, reason and capabilities in columns of their own."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
import warnings

MIN_DETAIL = 24  # narrowest wrapped column before the table just overflows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--wide", action="store_true", help="one line per backend, however long")


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def format_wrapped(rows: list[list[str]], width: int) -> str:
    """Like :func:`format_table`, the last column wrapped so lines stay within ``width``."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    indent = sum(widths) + 2 * len(widths)
    detail_w = max(MIN_DETAIL, width - indent)
    out = []
    for r in rows:
        head = "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  "
        parts = textwrap.wrap(r[-1], detail_w, break_on_hyphens=False) or [""]
        out.append((head + parts[0]).rstrip())
        out += [" " * indent + p for p in parts[1:]]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    from hwkv.plugins import list_backends

    with warnings.catch_warnings(record=True) as caught:  # show plugin warnings with the listing
        warnings.simplefilter("always")
        infos = list_backends()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
    elif args.wide:
        rows = [["NAME", "DISTRIBUTION", "VERSION", "AVAILABLE", "REASON", "CAPABILITIES"]]
        rows += [[i.name, i.dist, i.version, "yes" if i.available else "no", i.reason or "-", i.capabilities or "-"]
                 for i in infos]
        print(format_table(rows))
    else:
        rows = [["NAME", "DISTRIBUTION", "VERSION", "AVAILABLE", "REASON or CAPABILITIES"]]
        rows += [[i.name, i.dist, i.version, "yes" if i.available else "no",
                  (i.capabilities if i.available else i.reason) or "-"] for i in infos]
        print(format_wrapped(rows, shutil.get_terminal_size((100, 24)).columns))
    width = shutil.get_terminal_size((100, 24)).columns
    for w in caught:
        msg = f"warning: {w.message}"
        print(msg if args.wide or args.json else textwrap.fill(msg, max(width, MIN_DETAIL), subsequent_indent="  "),
              file=sys.stderr)
    return 0

"""``hwkv conformance --backend NAME [--certify] [--report DIR]``: run the conformance suite."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", required=True, help="backend to test (see `hwkv backends`)")
    parser.add_argument("--certify", action="store_true",
                        help="certification run: the full suite, suite tolerances, no extra options")
    parser.add_argument("--report", metavar="DIR", help="write conformance.json and conformance.md to DIR")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only tests matching EXPR (not with --certify)")
    parser.add_argument("--tolerance-override", action="append", default=[], metavar="DTYPE:OP=ATOL,RTOL",
                        help="replace one tolerance-table entry (not with --certify)")
    parser.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                        help="extra pytest arguments after `--` (not with --certify)")


def run(args: argparse.Namespace) -> int:
    extra = list(args.pytest_args)
    if args.keyword:
        extra += ["-k", args.keyword]
    for o in args.tolerance_override:
        extra.append(f"--tolerance-override={o}")
    if args.certify and extra:
        print("hwkv conformance: --certify refuses -k, --tolerance-override and extra pytest arguments",
              file=sys.stderr)
        return 2
    import conformance
    from hwkv.interfaces import BackendUnavailable

    try:
        report = conformance.run(args.backend, certify=args.certify, report_dir=args.report, pytest_args=extra)
    except (ValueError, BackendUnavailable) as e:
        print(f"hwkv conformance: {e}", file=sys.stderr)
        return 2
    s = report["summary"]
    counts = ", ".join(f"{k} {v}" for k, v in s.items() if k != "total" and v)
    print(f"\nconformance {report['suite_version']} · backend {report['backend']} ({report['backend_dist']} "
          f"{report['backend_version']}) on {report['device']}: {s['total']} tests — {counts}")
    if args.report:
        print(f"report: {args.report}/conformance.json, {args.report}/conformance.md")
    if args.certify:
        print("CERTIFIED" if report["certified"] else "NOT CERTIFIED: every test must be PASS or NOT_SUPPORTED")
        return 0 if report["certified"] else 1
    return 0 if report["all_pass_or_not_supported"] else 1

"""``hwkv conformance --backend NAME [--certify] [--report DIR]``: run the conformance suite."""

from __future__ import annotations

import argparse
import sys

MAX_AUTO_WORKERS = 12


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", required=True, help="backend to test (see `hwkv backends`)")
    parser.add_argument("--certify", action="store_true",
                        help="certification run: the full suite, suite tolerances, no extra options")
    parser.add_argument("--report", metavar="DIR", help="write conformance.json and conformance.md to DIR")
    parser.add_argument("--quick", action="store_true",
                        help="about a minute of smoke: one dtype, block size and head size per test "
                             "(not with --certify)")
    parser.add_argument("--workers", default="auto", metavar="N",
                        help="processes claiming tests from one list (default auto: 1 on the host, else up to 12 "
                             "by CPU count)")
    parser.add_argument("--devices", type=int, default=1, metavar="N",
                        help="devices to spread the workers over; >= 2 adds the multi-device tests (tensor "
                             "parallel engine, collectives, device-to-device transfer)")
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
    if args.certify and args.quick:
        print("hwkv conformance: --quick is a smoke subset; it cannot --certify", file=sys.stderr)
        return 2
    import conformance
    from hwkv.interfaces import BackendUnavailable

    try:
        workers = _workers(args.workers, args.backend)
        report = conformance.run(args.backend, certify=args.certify, report_dir=args.report, pytest_args=extra,
                                 workers=workers, devices=args.devices, quick=args.quick)
    except (ValueError, BackendUnavailable) as e:
        print(f"hwkv conformance: {e}", file=sys.stderr)
        return 2
    s = report["summary"]
    counts = ", ".join(f"{k} {v}" for k, v in s.items() if k != "total" and v)
    print(f"\nconformance {report['suite_version']} · backend {report['backend']} ({report['backend_dist']} "
          f"{report['backend_version']}) on {report['device']}: {s['total']} tests — {counts}")
    t = report.get("timing") or {}
    slow = ", ".join(f"{f['function']} {f['seconds']:.0f} s" for f in t.get("per_function", [])[:4])
    print(f"{report['duration_s']:.0f} s wall on {report.get('workers', 1)} worker(s) over {args.devices} device(s)"
          f"{f'; most test time: {slow}' if slow else ''}")
    md = (report.get("multi_device") or {}).get("tests") or []
    if md:
        ns = sum(x["status"] == "NOT_SUPPORTED" for x in md)
        print(f"multi-device: {sum(x['status'] == 'PASS' for x in md)} / {len(md)} passed"
              + (f", {ns} not supported" if ns else ""))
    if args.report:
        print(f"report: {args.report}/conformance.json, {args.report}/conformance.md")
    if args.certify:
        print("CERTIFIED" if report["certified"] else "NOT CERTIFIED: every test must be PASS or NOT_SUPPORTED")
        return 0 if report["certified"] else 1
    return 0 if report["all_pass_or_not_supported"] else 1


def _workers(value: str, backend: str) -> int:
    if value != "auto":
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"--workers takes a positive integer or 'auto', got {value!r}") from None
        if n < 1:
            raise ValueError(f"--workers must be >= 1, got {n}")
        return n
    import os

    from hwkv.plugins import get_backend

    if getattr(get_backend(backend).device, "visible_devices_env", None) is None:
        return 1  # the device is the host: its cores already run each test's ops
    # a worker's time on a GPU is mostly its Triton compiles, one host core each: up to 12 processes
    # share the device (its memory holds them easily), half the host's cores
    return max(1, min(MAX_AUTO_WORKERS, (os.cpu_count() or 2) // 2))

"""``python -m conformance.mutants [--only NAME ...] [--area AREA] [--markdown FILE] [--json FILE] [--list]``:
certify every mutant, print the mutation score (killed / total, and per interface); exit 0 when every
mutant is killed."""

from __future__ import annotations

import argparse
import sys

from conformance.mutants import AREAS, control, load, run_mutant


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conformance.mutants", description=__doc__)
    p.add_argument("--only", nargs="+", metavar="NAME", help="these mutants only")
    p.add_argument("--area", choices=AREAS, help="mutants of one interface only")
    p.add_argument("--markdown", metavar="FILE", help="write the score table (Markdown) to FILE")
    p.add_argument("--json", metavar="FILE", help="write the score (total, per interface, per mutant) as JSON to FILE")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--no-control", action="store_true", help="skip certifying the bug-free control first")
    p.add_argument("-v", "--verbose", action="store_true", help="show each conformance run's output")
    args = p.parse_args(argv)
    mutants = load()
    unknown = sorted(set(args.only or ()) - set(mutants))
    if unknown:
        p.error(f"unknown mutant(s) {unknown}; known: {sorted(mutants)}")
    chosen = [m for m in mutants.values() if (not args.only or m.name in args.only)
              and (not args.area or m.area == args.area)]
    if args.list:
        for m in chosen:
            print(f"{m.name:32} {m.area:10} {m.bug}")
        return 0
    if not args.no_control:  # the same pieces without a bug certify: every kill is the bug's
        import contextlib
        import io

        import conformance

        out = io.StringIO()
        with contextlib.redirect_stdout(out) if not args.verbose else contextlib.nullcontext():
            report = conformance.run(control(), certify=True)
        print(f"control (bug-free pieces): {'CERTIFIED' if report['certified'] else 'NOT CERTIFIED'} "
              f"({report['summary']['total']} tests, {report['duration_s']} s)", flush=True)
        if not report["certified"]:
            bad = [t for t in report["tests"] if t["status"] not in ("PASS", "NOT_SUPPORTED")]
            print(f"the control must certify; first failures: {bad[:3]}", file=sys.stderr)
            return 2
    rows = []
    for i, m in enumerate(chosen, 1):
        r = run_mutant(m, quiet=not args.verbose)
        rows.append(r)
        print(f"[{i}/{len(chosen)}] {'KILLED ' if r['killed'] else 'SURVIVED'} {m.name} ({r['seconds']} s, "
              f"{r['tests_run']} tests): {r['by']}", flush=True)
    killed = sum(r["killed"] for r in rows)
    print(f"\nmutation score: {killed} / {len(rows)} killed")
    for area in AREAS:
        part = [r for r in rows if r["area"] == area]
        if part:
            print(f"  {area:10} {sum(r['killed'] for r in part)} / {len(part)}")
    if args.markdown:
        per_area = ", ".join(f"{a} {sum(r['killed'] for r in rows if r['area'] == a)} / "
                             f"{sum(r['area'] == a for r in rows)}" for a in AREAS if any(r["area"] == a for r in rows))
        lines = [f"Mutation score: **{killed} / {len(rows)} killed**.", "", f"Per interface: {per_area}.", "",
                 "| mutant | area | vendor mistake | killed by |", "| --- | --- | --- | --- |"]
        for r in rows:
            by = (r["by"] or "SURVIVED").split(" (")[0]
            lines.append(f"| `{r['name']}` | {r['area']} | {r['bug']} | `{by}` |")
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.json:
        import json

        from conformance.tolerances import SUITE_VERSION

        areas = {a: {"killed": sum(r["killed"] for r in rows if r["area"] == a),
                     "total": sum(r["area"] == a for r in rows)} for a in AREAS if any(r["area"] == a for r in rows)}
        with open(args.json, "w") as f:
            json.dump({"suite_version": SUITE_VERSION, "killed": killed, "total": len(rows), "per_interface": areas,
                       "mutants": rows}, f, indent=1)
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Result collection and the JSON / Markdown report.

:class:`ReportPlugin` is a pytest plugin. It classifies every test into exactly one status:

* ``PASS``          the test body ran and every comparison held
* ``FAIL``          an ``AssertionError``: the backend disagrees with the reference
* ``NOT_SUPPORTED`` a skip raised by :func:`not_supported` — the backend's Capabilities exclude it
* ``ERROR``         any other exception (in setup, the test or teardown), or a collection error
* ``TIMEOUT``       the per-test time limit expired
* ``SKIPPED``       any other skip; never certifiable (certification accepts no skip lists)
"""

from __future__ import annotations

import json
import platform
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

NS_PREFIX = "NOT_SUPPORTED: "
STATUSES = ("PASS", "FAIL", "NOT_SUPPORTED", "ERROR", "TIMEOUT", "SKIPPED")
CERTIFIABLE = {"PASS", "NOT_SUPPORTED"}
DEFAULT_TIMEOUT_S = 120.0
SUITE_DIR = Path(__file__).resolve().parent


class TestTimeout(BaseException):  # BaseException: a test's `except Exception` must not swallow it
    __test__ = False


class _NotSupported(pytest.skip.Exception):  # type: ignore[misc, name-defined]
    """Raised only by :func:`not_supported`: a plain skip (from a backend, say) is never NOT_SUPPORTED."""


def not_supported(reasons: list[str] | str) -> None:
    """Skip the current test as NOT_SUPPORTED; ``reasons`` come from the backend's Capabilities."""
    if isinstance(reasons, str):
        reasons = [reasons]
    raise _NotSupported(NS_PREFIX + "; ".join(reasons))


def short_id(nodeid: str) -> str:
    """Node id relative to the suite folder, independent of where the suite is installed."""
    i = nodeid.rfind("conformance/")
    return nodeid[i + len("conformance/") :] if i >= 0 else nodeid


class Record:
    """What a test's ``check`` fixture measured: worst errors over all its comparisons."""

    def __init__(self) -> None:
        self.capability = ""
        self.max_abs: float | None = None
        self.max_rel: float | None = None
        self.tolerance: str | None = None

    def update(self, max_abs: float, max_rel: float, tolerance: str) -> None:
        if self.max_abs is None or max_abs >= self.max_abs:
            self.tolerance = tolerance
        self.max_abs = max(max_abs, self.max_abs or 0.0)
        self.max_rel = max(max_rel, self.max_rel or 0.0)


def _reason(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(excinfo.value).strip().splitlines()
    first = text[0] if text else ""
    return f"{excinfo.typename}: {first}"[:500] if first else excinfo.typename


def _raised_by_suite(excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    """A suite comparison failed (FAIL), as opposed to an ``assert`` inside backend code (ERROR)."""
    tb = excinfo.traceback
    return bool(tb) and Path(str(tb[-1].path)).resolve().parent == SUITE_DIR


class ReportPlugin:
    """Collects one result per test and writes the report at session end."""

    def __init__(self, backend: Any = None, run_first: Sequence[str] = (), stop_at_first_failure: bool = False) -> None:
        from conformance.coverage import Coverage

        self.backend = backend  # a Backend instance under test instead of a registered name
        self.run_first, self.stop_at_first_failure = tuple(run_first), stop_at_first_failure
        self.stopped_early: str | None = None
        self.coverage = Coverage()
        self.results: dict[str, dict[str, Any]] = {}
        self.records: dict[str, Record] = {}
        self.meta: dict[str, Any] = {}
        self.report: dict[str, Any] | None = None
        self.report_dir: Path | None = None
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._t0 = time.time()
        self.worker: tuple[Path, int] | None = None  # (directory, index) of a parallel worker
        self.multi_device_ids: list[str] = []
        self.collection_s: float | None = None

    # -- configuration (called by conformance/conftest.py) ------------------------------------
    def configure(self, meta: dict[str, Any], report_dir: str | None, timeout_s: float) -> None:
        self.meta = meta
        self.report_dir = Path(report_dir) if report_dir else None
        self.timeout_s = timeout_s

    def record(self, nodeid: str) -> Record:
        return self.records.setdefault(nodeid, Record())

    # -- order (verdict-preserving: only makes a failing run fail sooner) -----------------------
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.collection_s = round(time.time() - self._t0, 2)
        if self.run_first:
            items.sort(key=lambda it: not any(s in it.nodeid for s in self.run_first))

    # -- per-test time limit ------------------------------------------------------------------
    def _limit(self, item: pytest.Item) -> float:
        m = item.get_closest_marker("timeout_s")
        return float(m.args[0]) if m else self.timeout_s

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        return (yield from self._timed(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        return (yield from self._timed(item))

    def _timed(self, item: pytest.Item):
        usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        limit = self._limit(item)
        if not usable or limit <= 0:
            return (yield)

        def expire(signum: int, frame: Any) -> None:
            raise TestTimeout(f"test exceeded its {limit:g}s time limit")

        outer_left, _ = signal.getitimer(signal.ITIMER_REAL)  # e.g. pytest-timeout around an in-process run
        t0 = time.monotonic()
        old = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            return (yield)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            if outer_left > 0:
                signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - t0), 1e-3))

    # -- classification -----------------------------------------------------------------------
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):
        rep = yield
        status, reason = "PASS", ""
        exc = call.excinfo
        if exc is not None:
            if exc.errisinstance(pytest.skip.Exception):
                msg = str(exc.value.msg if hasattr(exc.value, "msg") else exc.value)
                if exc.errisinstance(_NotSupported):
                    status, reason = "NOT_SUPPORTED", msg[len(NS_PREFIX) :]
                else:
                    status, reason = "SKIPPED", msg
            elif exc.errisinstance(TestTimeout):
                status, reason = "TIMEOUT", str(exc.value)
            elif exc.errisinstance(AssertionError) and call.when == "call" and _raised_by_suite(exc):
                status, reason = "FAIL", _reason(exc)
            else:
                status, reason = "ERROR", f"{call.when}: {_reason(exc)}"
        if hasattr(rep, "wasxfail"):  # the suite has no xfails; one slipped in is never certifiable
            status, reason = "ERROR", f"xfail marker in the suite: {rep.wasxfail}"
        rep.hwkv_status, rep.hwkv_reason = status, reason
        if self.stop_at_first_failure and status not in CERTIFIABLE and not self.stopped_early:
            self.stopped_early = f"{short_id(item.nodeid)}: {status}"
            item.session.shouldstop = f"stop_at_first_failure: {self.stopped_early}"
        cap = item.get_closest_marker("capability")
        rep.hwkv_capability = cap.args[0] if cap else item.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        return rep

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        status = getattr(report, "hwkv_status", None)
        if status is None:
            return
        res = self.results.get(report.nodeid)
        if report.when == "setup" or res is None:
            res = self.results[report.nodeid] = {
                "id": short_id(report.nodeid),
                "capability": report.hwkv_capability,
                "status": status,
                "reason": report.hwkv_reason,
                "duration_s": 0.0,
            }
        res["duration_s"] = round(res["duration_s"] + report.duration, 4)
        if report.when == "call" or (report.when == "teardown" and status != "PASS" and res["status"] == "PASS"):
            res["status"], res["reason"] = status, report.hwkv_reason

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.results[f"collect::{report.nodeid}"] = {
                "id": f"collect::{short_id(report.nodeid)}",
                "capability": "collection",
                "status": "ERROR",
                "reason": str(report.longrepr).strip().splitlines()[-1][:500] if report.longrepr else "",
                "duration_s": 0.0,
            }

    # -- report -------------------------------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        tests = []
        for nodeid, res in self.results.items():
            rec = self.records.get(nodeid)
            if rec is not None:
                res["capability"] = rec.capability or res["capability"]
                res.update(max_abs_err=rec.max_abs, max_rel_err=rec.max_rel, tolerance=rec.tolerance)
            else:
                res.update(max_abs_err=None, max_rel_err=None, tolerance=None)
            tests.append(res)
        tests.sort(key=lambda r: r["id"])
        counts = Counter(r["status"] for r in tests)
        summary = {s: counts.get(s, 0) for s in STATUSES} | {"total": len(tests)}
        all_ok = bool(tests) and all(r["status"] in CERTIFIABLE for r in tests)
        meta = dict(self.meta)
        self.report = {
            **meta,
            "certified": bool(meta.get("certify")) and all_ok and not meta.get("emulated") and self.worker is None,
            "all_pass_or_not_supported": all_ok,
            "duration_s": round(time.time() - self._t0, 2),
            "collection_s": self.collection_s,
            "summary": summary,
            "stopped_early": self.stopped_early,
            "multi_device": {"devices": meta.get("devices", 1), "test_ids": sorted(self.multi_device_ids),
                             "tests": [{"id": t["id"], "status": t["status"]} for t in tests
                                       if t["id"] in set(self.multi_device_ids)]},
            "timing": timing(tests),
            "coverage": self.coverage.table(),
            "tests": tests,
        }
        if self.worker is not None:  # a partial report: only the merge of every worker's can certify
            directory, index = self.worker
            part = self.report | {"worker": index, "coverage_state": self.coverage.state()}
            (directory / f"part-{index}.json").write_text(json.dumps(part))
        elif self.report_dir is not None:
            write_report(self.report, self.report_dir)


def timing(tests: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the time went: seconds per test function (summed over its parametrisations), slowest tests."""
    per: dict[str, list[float]] = {}
    for t in tests:
        fn = t["id"].split("[")[0]
        per.setdefault(fn, []).append(t["duration_s"])
    funcs = sorted(((k, round(sum(v), 2), len(v)) for k, v in per.items()), key=lambda x: -x[1])
    slow = sorted(tests, key=lambda t: -t["duration_s"])[:15]
    return {"test_seconds": round(sum(t["duration_s"] for t in tests), 2),
            "per_function": [{"function": k, "seconds": s, "tests": n} for k, s, n in funcs],
            "slowest": [{"id": t["id"], "seconds": t["duration_s"]} for t in slow]}


def environment() -> dict[str, str]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def write_report(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    jp, mp = out / "conformance.json", out / "conformance.md"
    jp.write_text(json.dumps(report, indent=1) + "\n")
    mp.write_text(markdown(report))
    return jp, mp


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.3g}"


def markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    verdict = "CERTIFIED" if report["certified"] else "not certified"
    if not report.get("certify"):
        verdict = "not a certification run"
    lines = [
        f"# hwkv conformance: backend `{report.get('backend')}` — {verdict}",
        "",
        "| field | value |",
        "| --- | --- |",
    ]
    for key in ("suite_version", "hwkv_version", "backend", "backend_dist", "backend_version", "device",
                "worker_devices", "workers", "devices", "quick", "emulated", "seed", "certify", "certified",
                "tolerance_overrides", "duration_s", "collection_s"):
        if key in report:
            lines.append(f"| {key} | {report.get(key)} |")
    md = report.get("multi_device") or {}
    ran = ", ".join(f"`{t['id']}` {t['status']}" for t in md.get("tests", [])) or "none"
    lines.append(f"| ran on more than one device | {ran} |")
    lines += ["", "| " + " | ".join(STATUSES) + " | total |", "|" + " --- |" * (len(STATUSES) + 1)]
    lines.append("| " + " | ".join(str(s[k]) for k in STATUSES) + f" | {s['total']} |")
    bad = [t for t in report["tests"] if t["status"] not in CERTIFIABLE]
    if bad:
        lines += ["", "## Failures", "", "| test | status | reason |", "| --- | --- | --- |"]
        lines += [f"| `{t['id']}` | {t['status']} | {t['reason'].replace('|', '/')} |" for t in bad]
    lines += _coverage_md(report.get("coverage") or [])
    lines += ["", "## All tests", "", "| test | capability | status | max abs | max rel | tolerance | reason |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for t in report["tests"]:
        lines.append(
            f"| `{t['id']}` | {t['capability']} | {t['status']} | {_fmt(t['max_abs_err'])} | {_fmt(t['max_rel_err'])} "
            f"| {t['tolerance'] or ''} | {t['reason'].replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def _coverage_md(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    single = [f"`{r['method']}({r['arg']})`" for r in rows if r["distinct"] < 2]
    out = ["", "## Argument coverage", "",
           "Every argument of every interface method the suite called, with the distinct values it took "
           "(tensors: dtype, shape with the leading dimension bucketed, layout; lists: length). "
           + (f"Single-valued here: {', '.join(single)}." if single else "Every argument took several values."),
           "", "| method | argument | distinct | values |", "| --- | --- | --- | --- |"]
    for r in rows:
        vals = ", ".join(f"`{v}`" for v in r["values"]).replace("|", "/")
        more = f" (+{r['distinct'] - len(r['values'])} more)" if r["distinct"] > len(r["values"]) else ""
        out.append(f"| `{r['method']}` | `{r['arg']}` | {r['distinct']} | {vals}{more} |")
    return out

"""Parallel certification: N worker processes share one collected test list and claim tests from it.

Every worker collects the same items (collection is deterministic for one backend), then claims the
next unclaimed *group* of items from a counter in a shared directory (``fcntl`` lock), so the load
balances itself: Triton compiles, CPU reference computations and engine builds of different tests
overlap across processes and devices. A group (:func:`claim_groups`) is the tests of one function
that agree in every kernel-shaping parameter (:data:`KERNEL_PARAMS`: dtype, block size, head size,
GQA ratio, ...) and differ only in the scenario (attention state, write pattern). One worker runs a
group back to back, so a kernel specialisation the group's tests share is compiled once, in that
worker, and reused from its in-process cache. Claimed test by test, the four states of one shape went
to four workers at the same moment, each compiling the same kernels with nothing cached yet: on an
H200 that made ``test_attention`` ~2.9 s a test against 0.05-0.16 s on the CPU (6d17dc2's
certification, 1,394 of 3,127 worker-seconds). Groups of long tests (a larger ``timeout_s``) are
claimed first so that none of them is the run's tail. Tests marked ``multi_device`` (several devices
at once) run in worker 0, which sees every device, *before* it claims any group, beside the other
workers' groups (on 2 x H200 at 80e5a4c they ran last and were the final ~60 s of a 179 s run; their
engine is sized for the test, 64 KV blocks, so it leaves the others their memory). Tests marked
``serial`` (``memory_info`` probes, which read a device-wide figure other workers move) run after
every other test has *finished*, in worker 0 alone. Workers 1.. are restricted to one device each
(``Device.visible_devices_env``) round-robin over ``--devices``.

Each worker writes a partial report; :func:`merge` joins them. A partial report is never a
certification: only the merge certifies, and only when the workers ran every collected test exactly
once, all collected the same list and none died.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

WAIT_SERIAL_S = 1800.0  # bound on worker 0's wait for the others before the serial tests
# Parameters that choose a kernel specialisation (constexpr tile shapes, dtypes, head and block sizes,
# GQA group): tests of one function equal in all of them form one claim group. Every other parameter
# (state, pattern, op, ...) is a scenario run through the same kernels.
KERNEL_PARAMS = ("dtype", "block_size", "head_size", "gqa", "long_combo", "feature", "protocol")


def _bump(path: Path, limit: int | None = None) -> int:
    """Atomically read the counter at ``path`` and add one (unless it reached ``limit``)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0)
        if limit is None or n < limit:
            f.seek(0)
            f.truncate()
            f.write(str(n + 1))
        return n


def _read(path: Path) -> int:
    try:
        return int(path.read_text() or 0)
    except FileNotFoundError:
        return 0


def is_serial(item: pytest.Item) -> bool:
    return item.get_closest_marker("serial") is not None or item.get_closest_marker("multi_device") is not None


def claim_key(item: pytest.Item) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The test function and the values of its :data:`KERNEL_PARAMS`."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return item.nodeid.split("[")[0], tuple((k, str(params[k])) for k in KERNEL_PARAMS if k in params)


def _limit(item: pytest.Item) -> float:
    m = item.get_closest_marker("timeout_s")
    return float(m.args[0]) if m else 0.0


def claim_groups(items: list[pytest.Item]) -> list[list[pytest.Item]]:
    """``items`` as claim groups (same :func:`claim_key`), each in collection order; groups ordered by
    their longest per-test limit (``timeout_s``), longest first, then by collection order. Every item
    is in exactly one group."""
    groups: dict[tuple[str, tuple[tuple[str, str], ...]], list[pytest.Item]] = {}
    for it in items:
        groups.setdefault(claim_key(it), []).append(it)
    return sorted(groups.values(), key=lambda g: -max(_limit(it) for it in g))  # stable: ties keep order


class WorkerLoop:
    """pytest plugin of one worker: runs the items it claims (see module doc)."""

    def __init__(self, directory: str, index: int):
        self.dir, self.index = Path(directory), index

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> bool:
        items = session.items
        shared = [it for it in items if not is_serial(it)]
        multi = [it for it in items if it.get_closest_marker("multi_device") is not None]
        serial = [it for it in items if is_serial(it) and it not in multi]
        groups = claim_groups(shared)
        (self.dir / f"collected-{self.index}.json").write_text(json.dumps([it.nodeid for it in items]))
        if session.config.option.collectonly:
            return True
        counter, finished = self.dir / "next", self.dir / "finished"
        claim = lambda: _bump(counter, limit=len(groups))
        times = open(self.dir / f"times-{self.index}.txt", "a", buffering=1)  # noqa: SIM115  (streamed: survives a kill)
        run = lambda item, nxt: self._run(item, nxt, times)
        for k, item in enumerate(multi if self.index == 0 else ()):
            run(item, multi[k + 1] if k + 1 < len(multi) else None)
            if session.shouldstop:
                times.close()
                return True
        g = claim()
        queue = list(groups[g]) if g < len(groups) else []
        while queue:
            item = queue.pop(0)
            if not queue:  # the group's last test: claim the next group now, pytest's teardown needs it
                g = claim()
                queue = list(groups[g]) if g < len(groups) else []
            nxt = queue[0] if queue else (serial[0] if serial and self.index == 0 else None)
            run(item, nxt)
            _bump(finished)
            if session.shouldstop:
                break
        if self.index == 0 and serial:
            deadline = time.monotonic() + WAIT_SERIAL_S
            while _read(finished) < len(shared) and time.monotonic() < deadline:
                if (self.dir / "abort").exists():
                    return True
                time.sleep(0.2)
            for k, item in enumerate(serial):
                run(item, serial[k + 1] if k + 1 < len(serial) else None)
        times.close()
        return True

    @staticmethod
    def _run(item: pytest.Item, nxt: pytest.Item | None, times: Any) -> None:
        t0 = time.monotonic()
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt)
        times.write(f"{time.monotonic() - t0:8.2f} {item.nodeid}\n")


def threads(workers: int) -> dict[str, str]:
    """Each worker's share of the host's cores for torch's CPU ops (the reference oracle, inputs,
    comparisons), unless the caller chose: by default every worker's torch would start one thread per
    core, and N workers' thread pools oversubscribing the host make each small op wait on the
    others' (2x slower on a 2-core host at 16 threads; worse with 8 workers on 16 cores)."""
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // workers))}


def visible(backend_env: str | None, devices: int, index: int) -> dict[str, str]:
    """Environment of worker ``index``: workers 1.. see one device each, round-robin."""
    if backend_env is None or devices <= 1 or index == 0:
        return {}
    have = os.environ.get(backend_env)
    ids = have.split(",") if have else [str(d) for d in range(devices)]
    return {backend_env: ids[index % min(devices, len(ids))]}


def spawn_logged(cmd: list[str], env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen, Any]:
    """``cmd`` started with its stdout and stderr in ``log_path``; :func:`reap` closes the log."""
    log = open(log_path, "w")  # noqa: SIM115  (closed by reap)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log


def reap(procs: list[tuple[subprocess.Popen, Any]]) -> None:
    """Kill the processes of :func:`spawn_logged` still running (the waits before are bounded), wait
    for them, close their logs: no test leaves a process behind."""
    for p, log in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
        log.close()


def run_workers(name: str, workers: int, devices: int, args: list[str], visible_env: str | None,
                directory: Path, quiet: bool = False) -> list[dict[str, Any]]:
    """Start ``workers`` pytest processes on the suite and wait; their partial reports."""
    from conformance import SUITE_DIR

    directory.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(workers):
        env = dict(os.environ) | threads(workers) | visible(visible_env, devices, i)
        cmd = [sys.executable, "-m", "pytest", str(SUITE_DIR), "--backend", name, "-p", "no:cacheprovider", "-q",
               "-rfE", f"--worker-dir={directory}", f"--worker-index={i}", f"--devices={devices}", *args]
        procs.append(spawn_logged(cmd, env, directory / f"worker-{i}.log"))
    t0, last = time.monotonic(), 0.0
    try:
        while any(p.poll() is None for p, _ in procs):
            if any(p.poll() not in (None, 0, 1) for p, _ in procs):  # a worker died: stop worker 0's wait
                (directory / "abort").touch()
            if not quiet and time.monotonic() - last > 15:
                last = time.monotonic()
                total = _total(directory)
                print(f"[{time.monotonic() - t0:6.0f} s] {_read(directory / 'finished')}"
                      f"{f' / {total}' if total else ''} tests finished on {workers} workers", flush=True)
            time.sleep(0.5)
    finally:
        reap(procs)
    parts = []
    for i, (p, _) in enumerate(procs):
        f = directory / f"part-{i}.json"
        part = json.loads(f.read_text()) if f.exists() else None
        if part is None and not quiet:
            print(f"worker {i} exited {p.returncode} without a report; its log:\n"
                  + (directory / f"worker-{i}.log").read_text()[-3000:], file=sys.stderr)
        parts.append({"index": i, "returncode": p.returncode, "report": part})
    return parts


def _total(directory: Path) -> int:
    f = directory / "collected-0.json"
    try:
        return len(json.loads(f.read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def merge(parts: list[dict[str, Any]], directory: Path) -> dict[str, Any]:
    """One report from the workers' partial reports (see module doc for when it certifies)."""
    from conformance.coverage import Coverage
    from conformance.report import CERTIFIABLE, STATUSES, short_id, timing

    problems = []
    reports = [p["report"] for p in parts if p["report"] is not None]
    if len(reports) != len(parts):
        problems.append(f"workers {[p['index'] for p in parts if p['report'] is None]} left no report")
    collected = []
    for p in parts:
        f = directory / f"collected-{p['index']}.json"
        collected.append(json.loads(f.read_text()) if f.exists() else None)
    if not reports or not collected[0]:
        raise ValueError(f"conformance workers produced no report ({problems}); see {directory}/worker-*.log")
    want = [short_id(n) for n in collected[0]]
    if any(c is not None and c != collected[0] for c in collected):
        problems.append("workers collected different test lists")
    tests: dict[str, dict[str, Any]] = {}
    ran = Counter()
    cov = Coverage()
    for r in reports:
        for t in r["tests"]:
            if t["id"].startswith("collect::"):
                tests[t["id"]] = t
                continue
            ran[t["id"]] += 1
            tests[t["id"]] = t
        cov.merge(r.get("coverage_state") or [])
    for tid in want:
        if tid not in tests:
            tests[tid] = {"id": tid, "capability": "", "status": "ERROR", "reason": "not run: its worker died",
                          "duration_s": 0.0, "max_abs_err": None, "max_rel_err": None, "tolerance": None}
    twice = sorted(t for t, n in ran.items() if n > 1)
    if twice:
        problems.append(f"tests run more than once: {twice[:5]}")
    out = sorted(tests.values(), key=lambda t: t["id"])
    counts = Counter(t["status"] for t in out)
    all_ok = bool(out) and all(t["status"] in CERTIFIABLE for t in out) and not problems
    head = reports[0]
    devices = sorted({r["device"] for r in reports})
    report = {k: v for k, v in head.items() if k not in ("tests", "coverage", "coverage_state", "summary",
                                                          "worker", "certified", "all_pass_or_not_supported")}
    report.update(
        certified=bool(head.get("certify")) and all_ok and not head.get("emulated"),
        all_pass_or_not_supported=all_ok,
        summary={s: counts.get(s, 0) for s in STATUSES} | {"total": len(out)},
        workers=len(parts), worker_devices=devices, parallel_problems=problems,
        collection_s=max((r.get("collection_s") or 0) for r in reports), timing=timing(out),
        coverage=cov.table(), tests=out,
        multi_device=_multi(out, head),
    )
    return report


def _multi(tests: list[dict[str, Any]], head: dict[str, Any]) -> dict[str, Any]:
    md = head.get("multi_device") or {}
    ids = set(md.get("test_ids") or ())
    return {"devices": md.get("devices", 1), "tests": [{"id": t["id"], "status": t["status"]} for t in tests
                                                       if t["id"] in ids]}

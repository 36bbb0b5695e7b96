"""hwkv conformance suite: proves a backend behaves identically to the CPU reference backend.

Run it as ``hwkv conformance --backend NAME [--certify] [--report DIR]``, as
``pytest conformance --backend NAME``, or in-process with :func:`run`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance.tolerances import SUITE_VERSION

if TYPE_CHECKING:
    from hwkv.interfaces import Backend

SUITE_DIR = Path(__file__).resolve().parent

__all__ = ["SUITE_DIR", "SUITE_VERSION", "run"]


def run(
    backend: str | Backend,
    certify: bool = False,
    report_dir: str | Path | None = None,
    pytest_args: Sequence[str] = (),
    *,
    run_first: Sequence[str] = (),
    stop_at_first_failure: bool = False,
    workers: int = 1,
    devices: int = 1,
    quick: bool = False,
) -> dict[str, Any]:
    """Run the suite in this process against ``backend``; return the JSON report as a dict.

    ``backend`` is a registered name or a :class:`~hwkv.interfaces.Backend` instance (an unregistered
    backend, e.g. a mutant of the reference in ``conformance.mutants``). ``pytest_args`` (selection
    such as ``-k``, ``--tolerance-override``, ...) are refused with ``certify``. ``run_first`` (test id
    substrings run before the others) and ``stop_at_first_failure`` only shorten a failing run: a
    run stops only after a test that is not PASS or NOT_SUPPORTED, so they never turn a failing run
    into a certified one (the report says ``stopped_early``). ``workers`` > 1 runs the suite in that
    many processes that claim tests from one shared list (:mod:`conformance.parallel`; a registered
    backend name only); ``devices`` >= 2 spreads the workers over that many devices and adds the
    multi-device tests; ``quick`` is the smoke subset (never a certification). Raises ``ValueError`` for an unknown
    backend or refused arguments and :class:`hwkv.interfaces.BackendUnavailable` when the backend
    cannot run here.
    """
    import pytest

    from conformance.report import ReportPlugin
    from hwkv.interfaces import Backend
    from hwkv.plugins import get_backend

    instance = backend if isinstance(backend, Backend) else None
    if instance is None and (not isinstance(backend, str) or not backend):
        raise ValueError(f"backend must be a backend name or a Backend instance, got {backend!r}")
    if certify and pytest_args:
        raise ValueError(
            "certify=True refuses selection, tolerance overrides and extra options; "
            f"got pytest_args={list(pytest_args)}"
        )
    name = instance.name if instance is not None else backend
    if instance is None:
        get_backend(name)  # fail fast with the plugin manager's reason
    if quick and certify:
        raise ValueError("quick=True is a smoke subset; it cannot certify")
    if workers < 1 or devices < 1:
        raise ValueError(f"workers and devices must be >= 1, got workers={workers}, devices={devices}")
    opts = (["--certify"] if certify else []) + (["--quick"] if quick else [])
    if workers > 1:
        if instance is not None or run_first or stop_at_first_failure:
            raise ValueError("workers > 1 takes a registered backend name, without run_first/stop_at_first_failure")
        return _run_parallel(name, workers, devices, [*opts, *pytest_args], report_dir)
    args = [str(SUITE_DIR), "--backend", name, "-p", "no:cacheprovider", "-q", "-rfE", f"--devices={devices}", *opts]
    if report_dir is not None:
        args += ["--report", str(report_dir)]
    plugin = ReportPlugin(instance, run_first=run_first, stop_at_first_failure=stop_at_first_failure)
    code = pytest.main([*args, *pytest_args], plugins=[plugin])
    if plugin.report is None:
        raise ValueError(f"conformance run did not complete (pytest exit code {int(code)}); see the output above")
    plugin.report["pytest_exit_code"] = int(code)
    return plugin.report


def _run_parallel(name: str, workers: int, devices: int, args: list[str],
                  report_dir: str | Path | None) -> dict[str, Any]:
    import os
    import tempfile
    import time

    from conformance.parallel import merge, run_workers
    from conformance.report import write_report
    from hwkv.plugins import get_backend

    env = getattr(get_backend(name).device, "visible_devices_env", None)
    t0 = time.time()
    keep = os.environ.get("HWKV_CONFORMANCE_WORKDIR")  # keep the workers' logs and per-test times there
    with tempfile.TemporaryDirectory(prefix="hwkv-conformance-") as d:
        d = keep or d
        parts = run_workers(name, workers, devices, args, env, Path(d))
        report = merge(parts, Path(d))
    report["duration_s"] = round(time.time() - t0, 2)
    report["pytest_exit_code"] = max((p["returncode"] or 0) for p in parts)
    if report_dir is not None:
        write_report(report, Path(report_dir))
    return report

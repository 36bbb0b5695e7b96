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
) -> dict[str, Any]:
    """Run the suite in this process against ``backend``; return the JSON report as a dict.

    ``backend`` is a registered name or a :class:`~hwkv.interfaces.Backend` instance (an unregistered
    backend, e.g. a mutant of the reference in ``conformance.mutants``). ``pytest_args`` (selection
    such as ``-k``, ``--tolerance-override``, ...) are refused with ``certify``. ``run_first`` (test id
    substrings run before the others) and ``stop_at_first_failure`` only shorten a failing run: a
    run stops only after a test that is not PASS or NOT_SUPPORTED, so they never turn a failing run
    into a certified one (the report says ``stopped_early``). Raises ``ValueError`` for an unknown
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
    args = [str(SUITE_DIR), "--backend", name, "-p", "no:cacheprovider", "-q", "-rfE"]
    if certify:
        args.append("--certify")
    if report_dir is not None:
        args += ["--report", str(report_dir)]
    plugin = ReportPlugin(instance, run_first=run_first, stop_at_first_failure=stop_at_first_failure)
    code = pytest.main([*args, *pytest_args], plugins=[plugin])
    if plugin.report is None:
        raise ValueError(f"conformance run did not complete (pytest exit code {int(code)}); see the output above")
    plugin.report["pytest_exit_code"] = int(code)
    return plugin.report

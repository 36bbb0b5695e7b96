"""hwkv conformance suite: proves a backend behaves identically to the CPU reference backend.

Run it as ``hwkv conformance --backend NAME [--certify] [--report DIR]``, as
``pytest conformance --backend NAME``, or in-process with :func:`run`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conformance.tolerances import SUITE_VERSION

SUITE_DIR = Path(__file__).resolve().parent

__all__ = ["SUITE_DIR", "SUITE_VERSION", "run"]


def run(
    backend: str,
    certify: bool = False,
    report_dir: str | Path | None = None,
    pytest_args: Sequence[str] = (),
) -> dict[str, Any]:
    """Run the suite in this process against ``backend``; return the JSON report as a dict.

    ``pytest_args`` (selection such as ``-k``, ``--tolerance-override``, ...) are refused with
    ``certify``. Raises ``ValueError`` for an unknown backend or refused arguments and
    :class:`hwkv.interfaces.BackendUnavailable` when the backend cannot run here.
    """
    import pytest

    from conformance.report import ReportPlugin
    from hwkv.plugins import get_backend

    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name, got {backend!r}")
    if certify and pytest_args:
        raise ValueError(
            "certify=True refuses selection, tolerance overrides and extra options; "
            f"got pytest_args={list(pytest_args)}"
        )
    get_backend(backend)  # fail fast with the plugin manager's reason
    args = [str(SUITE_DIR), "--backend", backend, "-p", "no:cacheprovider", "-q", "-rfE"]
    if certify:
        args.append("--certify")
    if report_dir is not None:
        args += ["--report", str(report_dir)]
    plugin = ReportPlugin()
    code = pytest.main([*args, *pytest_args], plugins=[plugin])
    if plugin.report is None:
        raise ValueError(f"conformance run did not complete (pytest exit code {int(code)}); see the output above")
    plugin.report["pytest_exit_code"] = int(code)
    return plugin.report

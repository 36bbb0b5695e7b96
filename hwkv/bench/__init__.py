"""Benchmarks behind ``hwkv bench``; :func:`results_dir` is where they write by default."""

from __future__ import annotations

import os
from pathlib import Path


def results_dir() -> Path:
    """Default output directory of every bench, whatever the current directory:
    ``$HWKV_BENCH_RESULTS`` if set, else ``bench/results`` of the source checkout hwkv runs from
    (a clone, editable install), else ``$XDG_CACHE_HOME/hwkv/bench-results`` (a wheel install has
    no checkout). Created if missing."""
    env = os.environ.get("HWKV_BENCH_RESULTS")
    if env:
        out = Path(env)
    else:
        repo = Path(__file__).resolve().parents[2]
        if (repo / "pyproject.toml").is_file() and (repo / "bench").is_dir():
            out = repo / "bench" / "results"
        else:
            out = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hwkv" / "bench-results"
    out.mkdir(parents=True, exist_ok=True)
    return out

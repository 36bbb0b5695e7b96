"""The fp8 KV section of the conformance suite has teeth: its mutants (conformance/mutants/fp8.py) are
killed by a certification run, each by the test meant for it. The bug-free control certifying with
the fp8 section in it is checked by ``python -m conformance.mutants`` (the full run)."""

from __future__ import annotations

import pytest

from conformance.mutants import load, run_mutant

FP8 = ["fp8-write-truncates", "fp8-write-head0-scale", "fp8-write-no-saturation", "fp8-read-k-scale-for-v"]


def test_fp8_mutants_registered():
    names = {n for n in load() if n.startswith("fp8-")}
    assert len(names) >= 7 and set(FP8) <= names


@pytest.mark.parametrize("name", FP8)
def test_fp8_mutant_killed(name):
    r = run_mutant(load()[name])
    assert r["killed"] and "test_fp8_kv.py" in r["by"], r

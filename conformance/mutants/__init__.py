"""Mutation harness: single-bug mutants of the reference backend; each must fail ``--certify``.

The suite's own bar: every mutant is a realistic vendor mistake in one interface piece (see
:mod:`conformance.mutants.base`); the mutation score is killed / total. Run it with
``python -m conformance.mutants`` (all, a few minutes on two cores) or ``--only NAME ...``.
A mutant counts as killed when a certification run of it is not certified; the run executes the
mutant's likely killers first and stops after the first test that is not PASS / NOT_SUPPORTED
(``conformance.run(..., run_first=..., stop_at_first_failure=True)``), which cannot change the verdict.
"""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

from conformance.mutants.base import AREAS, MUTANTS, Mutant, MutantBackend, mutant

__all__ = ["AREAS", "MUTANTS", "Mutant", "MutantBackend", "control", "controls", "load", "mutant", "run_mutant"]


def load() -> dict[str, Mutant]:
    """Every registered mutant, by name (importing the area modules registers them)."""
    import conformance.mutants.audit  # noqa: F401  (session 7's adversarial audit)
    from conformance.mutants import attention, collectives, device, elementwise, fp8, kv_write, runtime, transfer_store  # noqa: F401

    return MUTANTS


def control() -> MutantBackend:
    """Every piece the mutants modify, without a bug: the vendor-style attention, the validating
    device copy, the pass-through transfer wrapper and store subclass, the kernel-shaped elementwise
    ops. It certifies, so each mutant fails because of its bug alone."""
    from conformance.mutants.attention import VendorImpl
    from conformance.mutants.device import _copy, _device
    from conformance.mutants.elementwise import VendorElementwise
    from conformance.mutants.transfer_store import _Store, _Transfer

    return MutantBackend("mutant-control", impl=VendorImpl, device=_device("control", copy_blocks=_copy()),
                         transfer=_Transfer, store=_Store, elementwise=VendorElementwise,
                         spec="mutant:control")


def controls() -> dict[str, MutantBackend]:
    """Bug-free controls by name: ``control`` (every piece the mutants modify), and the devices the
    runtime and communicator mutants need: ``control-graphs`` (emulated graphs), ``control-lazy``
    (lazy side streams), ``control-host-copy`` (``to_host_async`` on a lazy copy stream),
    ``control-collectives`` (a correct custom all-reduce), ``control-collectives-graphs`` (the same,
    captured into emulated graphs), ``control-elementwise-graphs`` (the elementwise ops under emulated
    graphs)."""
    from conformance.mutants.collectives import collectives_device, graph_collectives_pieces
    from conformance.mutants.elementwise import graph_pieces
    from conformance.mutants.runtime import AsyncHostCopyDevice, graph_backend, lazy_backend

    return {"control": control(), "control-graphs": graph_backend("control-graphs"),
            "control-lazy": lazy_backend("control-lazy"),
            "control-host-copy": lazy_backend("control-host-copy", AsyncHostCopyDevice),
            "control-collectives": MutantBackend("mutant-control-collectives", device=collectives_device(None),
                                                 spec="mutant:control-collectives"),
            "control-collectives-graphs": MutantBackend("mutant-control-collectives-graphs",
                                                        spec="mutant:control-collectives-graphs",
                                                        **graph_collectives_pieces(stale=False)),
            "control-elementwise-graphs": MutantBackend("mutant-control-elementwise-graphs",
                                                        spec="mutant:control-elementwise-graphs", **graph_pieces())}


def run_mutant(m: Mutant, quiet: bool = True) -> dict[str, Any]:
    """Certify mutant ``m``; ``killed`` is True when the run is not certified, ``by`` names the test."""
    import conformance

    t0 = time.monotonic()
    out = io.StringIO()
    with contextlib.redirect_stdout(out) if quiet else contextlib.nullcontext():
        report = conformance.run(m.build(), certify=True, run_first=m.first, stop_at_first_failure=True)
    bad = [t for t in report["tests"] if t["status"] not in ("PASS", "NOT_SUPPORTED")]
    by = f"{bad[0]['id']} ({bad[0]['status']}: {bad[0]['reason'][:120]})" if bad else None
    return {"name": m.name, "area": m.area, "bug": m.bug, "killed": not report["certified"], "by": by,
            "tests_run": report["summary"]["total"], "seconds": round(time.monotonic() - t0, 1)}

"""Several devices (or ranks on the host): collectives and the tensor-parallel engine.

* Collectives: two ranks (one process and device each; gloo on the host, the backend's
  ``Device.dist_backend`` elsewhere) run the :class:`~hwkv.interfaces.communicator.Communicator`
  contract through the communicator the engine uses — all_reduce in place at 1 element .. 32 MiB
  in every declared dtype, all_gather along both ends, broadcast from the last rank — and the
  backend's ``Device.custom_all_reduce`` where it offers one, at the same sizes; where the backend
  captures graphs, an all_reduce captured into a graph and replayed after its input changed in
  place. Results must equal the sum computed on the host (two ranks: one rounding, whatever the
  order) and be bitwise identical on both ranks.
* Tensor parallelism: the tiny model at ``tensor_parallel_size=2`` gives the reference engine's
  greedy tokens (float32: identical; half precision: the margin rule of ``TinySetup.agree``).

They run with ``--devices 2`` or more, and always on a backend whose device is the host.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from conformance.parallel import reap, spawn_logged
from conformance.report import not_supported
from conformance.test_engine import generate, setup, tiny  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.multi_device, pytest.mark.timeout_s(300)]
WORLD = 2


def run_ranks(spec: str, scenario: str, visible_env: str | None, timeout_s: float = 240.0,
              coverage: Any = None) -> list[dict]:
    """``WORLD`` rank processes of :mod:`conformance.ranks`; their results (rank order). Each rank's
    argument coverage is merged into ``coverage`` (the run's)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="hwkv-ranks-") as d:
        procs = []
        have = os.environ.get(visible_env) if visible_env else None
        ids = have.split(",") if have else [str(i) for i in range(WORLD)]
        for r in range(WORLD):
            env = dict(os.environ)
            if visible_env:
                env[visible_env] = ids[r % len(ids)]
            cmd = [sys.executable, "-m", "conformance.ranks", spec, str(r), str(WORLD), str(store.port), scenario,
                   str(Path(d) / f"rank{r}.json")]
            procs.append(spawn_logged(cmd, env, Path(d) / f"rank{r}.log"))
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            reap(procs)
        out = []
        for r in range(WORLD):
            f = Path(d) / f"rank{r}.json"
            if not f.exists():
                tail = (Path(d) / f"rank{r}.log").read_text()[-1500:]
                raise RuntimeError(f"rank {r} left no result (exit {procs[r][0].returncode}); its log ends:\n{tail}")
            out.append(json.loads(f.read_text()))
    for r in out:
        if coverage is not None and r.get("coverage"):
            coverage.merge(r["coverage"])
    return out


@pytest.mark.capability("communicator")
def test_collectives(backend, check, backend_spec, coverage_log):
    res = run_ranks(backend_spec, "collectives", backend.device.visible_devices_env, coverage=coverage_log)
    errors = [f"rank {r['rank']}: {r['error']}" for r in res if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    bad = [f"rank {r['rank']}: {c[0]}: {c[2]}" for r in res for c in r["checks"] if not c[1]]
    check.rec.update(float(len(bad)), float(len(bad)), "exact (host sum of two ranks)")
    assert not bad, f"{len(bad)} collective checks failed: {bad[:4]}"
    assert len({r["digest"] for r in res}) == 1, "collective results differ between ranks (must be bitwise identical)"
    assert res[0]["checks"], "no collective ran"


@pytest.mark.capability("engine")
@pytest.mark.registered_backend
def test_tensor_parallel_engine(engine_backend, check, setup, pytestconfig):  # noqa: F811
    """tp=2 greedy tokens agree with the reference (tp=1), prompts crossing blocks, prefix shared."""
    prompts = setup.prompts([setup.block_size + 5, 7, 2 * setup.block_size + 1], seed=21, shared_prefix=9)
    got, _ = generate(pytestconfig.option.backend, setup, prompts, 16, tensor_parallel_size=2)
    setup.agree(check, got, prompts, 16, "tensor_parallel_size=2 greedy tokens vs the reference engine")


@pytest.mark.capability("transfer")
def test_direct_transfer_between_devices(backend, check, backend_spec, coverage_log):
    """Device-direct transfer across two devices (two processes, one device each): each rank writes
    segments of odd lengths at odd offsets (1 B .. 1 MiB + 1) into the next rank's registered buffer in
    two batches in flight at once, waited out of order, and reads the previous rank's buffer whole
    (4 MiB), over every declared same-host direct protocol (``cuda_ipc`` between two GPUs, ``cma``
    between two host processes). Nothing outside the segments may change."""
    from hwkv.transfer.direct import DIRECT_PROTOCOLS

    declared = backend.capabilities.transfer_protocols
    direct = [p for p in declared if p in DIRECT_PROTOCOLS]
    if not direct:
        not_supported(f"no same-host direct protocol declared (declared: {list(declared)}; direct ones: "
                      f"{', '.join(DIRECT_PROTOCOLS)})")
    res = run_ranks(backend_spec, "direct_transfer", backend.device.visible_devices_env, coverage=coverage_log)
    errors = [f"rank {r['rank']}: {r['error']}" for r in res if "error" in r]
    if errors:
        raise RuntimeError("; ".join(errors))
    bad = [f"rank {r['rank']}: {c[0]}: {c[2]}" for r in res for c in r["checks"] if not c[1]]
    check.rec.update(float(len(bad)), float(len(bad)), "exact (bytes)")
    assert not bad, f"{len(bad)} transfer checks failed: {bad[:4]}"
    assert all(len(r["checks"]) == 2 * len(direct) for r in res), "a rank ran fewer transfer checks than protocols"

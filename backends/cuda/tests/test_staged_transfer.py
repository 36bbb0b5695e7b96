"""GPU KV blocks over a real Mooncake tcp transfer, staged through pinned host buffers (the path the
backend declares without RDMA devices): every byte checked, every registration released. On a CPU
machine the same script runs with the reference backend (host caches on both sides), which tests
everything but the GPU copies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hwkv.interfaces import KVCacheSpec
from hwkv.plugins import get_backend
from hwkv.testing.mooncake import skip_unless_mooncake

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "staged_transfer.py"


def _script():
    spec = importlib.util.spec_from_file_location("staged_transfer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="stages GPU memory: needs a CUDA GPU"))])
def test_blocks_round_trip_through_host_and_tcp(name):
    skip_unless_mooncake()
    if name == "cuda":
        from hwkv_cuda.backend import CudaBackend

        backend = CudaBackend()
    else:
        backend = get_backend(name)
    assert "tcp" in backend.capabilities.transfer_protocols, backend.capabilities.transfer_reason
    spec = KVCacheSpec(3, 16, 16, 2, 64, torch.bfloat16)
    res = _script().round_trip(backend, spec, [5, 6, 7, 2, 0, 15], [0, 1, 2, 9, 4, 10], repeats=2)
    # 5-7 -> 0-2 merge; 2, 0 and 15 stay single: four runs in each of the three layers' tensors
    assert res["segments"] == 4 * 3 and res["bytes"] == 6 * 3 * 2 * 16 * 2 * 64 * 2

"""GPU KV blocks over a real Mooncake tcp transfer, staged through pinned host buffers (the path the
backend declares without RDMA devices): every byte checked, every registration released."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from hwkv.interfaces import KVCacheSpec
from hwkv.testing.mooncake import skip_unless_mooncake

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="stages GPU memory: needs a CUDA GPU")
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "staged_transfer.py"


def _script():
    spec = importlib.util.spec_from_file_location("staged_transfer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_blocks_round_trip_through_pinned_host_and_tcp():
    skip_unless_mooncake()
    from hwkv_cuda.backend import CudaBackend

    backend = CudaBackend()
    assert "tcp" in backend.capabilities.transfer_protocols, backend.capabilities.transfer_reason
    spec = KVCacheSpec(3, 16, 16, 2, 64, torch.bfloat16)
    res = _script().round_trip(backend, spec, [5, 6, 7, 2, 0, 15], [0, 1, 2, 9, 4, 10], repeats=2)
    # 5-7 -> 0-2 merge; 2, 0 and 15 stay single: four runs in each of the three layers' tensors
    assert res["segments"] == 4 * 3 and res["bytes"] == 6 * 3 * 2 * 16 * 2 * 64 * 2

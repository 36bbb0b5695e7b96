"""The CUDA backend for GPU-only tests: skips (with the reason) where there is no GPU or no hwkv_cuda."""

from __future__ import annotations

from typing import Any


def cuda_backend_or_skip() -> Any:
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        from hwkv_cuda.backend import CudaBackend
    except ImportError as e:
        pytest.skip(f"hwkv_cuda not importable: {e}")
    return CudaBackend()

"""The package imports without a GPU or Triton and reports itself unavailable on a CPU machine."""

import subprocess
import sys

import pytest
import torch

from hwkv.interfaces.backend import BackendUnavailable


def test_import_needs_no_gpu_and_no_triton():
    code = ("import sys, hwkv_cuda, hwkv_cuda.plugin, hwkv_cuda.backend, hwkv_cuda.device, hwkv_cuda.attention;"
            "assert 'triton' not in sys.modules, 'triton imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ, "PYTHONPATH":
                   ":".join(sys.path)})


def test_plugin_hook_returns_spec():
    from hwkv_cuda import plugin

    (spec,) = plugin.hwkv_backends()
    assert spec.name == "cuda" and spec.factory == "hwkv_cuda.backend:CudaBackend"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine behaviour")
def test_unavailable_on_cpu_with_reason():
    from hwkv_cuda.backend import CudaBackend

    ok, reason = CudaBackend.availability()
    assert not ok and "no CUDA device" in reason and torch.__version__ in reason
    with pytest.raises(BackendUnavailable, match="no CUDA device"):
        CudaBackend()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine behaviour")
def test_listed_unavailable_through_plugins():
    plugins = pytest.importorskip("hwkv.plugins")
    infos = {i.name: i for i in plugins.list_backends()}
    if "cuda" not in infos:
        pytest.skip("hwkv-cuda is not installed (pip install -e backends/cuda)")
    assert not infos["cuda"].available and "no CUDA device" in infos["cuda"].reason
    with pytest.raises(BackendUnavailable):
        plugins.get_backend("cuda")


def test_transfer_choice_states_protocol():
    from hwkv_cuda.backend import rdma_devices, transfer_choice

    protocols, why = transfer_choice()
    assert protocols[0] == "cuda_ipc" and "one host" in why  # device-direct first, needs no Mooncake
    if protocols == ("cuda_ipc",):
        assert "mooncake" in why
    elif rdma_devices():
        assert protocols[1:] == ("rdma", "tcp")
    else:
        assert protocols[1:] == ("tcp",) and "pinned host" in why

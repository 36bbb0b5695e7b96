"""The CUDA backend: torch.cuda device, Triton attention, Mooncake transfer (rdma or tcp staging)."""

from __future__ import annotations

import os

import torch

from hwkv.interfaces.backend import Backend, BackendUnavailable
from hwkv.interfaces.capabilities import Capabilities
from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.interfaces.layout import KVLayoutKind

IB_DIR = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(IB_DIR))
    except OSError:
        return []


def transfer_choice() -> tuple[tuple[str, ...], str]:
    """``rdma`` (GPU memory registered, GPUDirect) when RDMA devices exist, else ``tcp`` staged
    through pinned host buffers; none without the Mooncake wheel."""
    from hwkv.transfer.mooncake import NOT_INSTALLED, engine_installed

    if not engine_installed():
        return (), NOT_INSTALLED
    devs = rdma_devices()
    if devs:
        return ("rdma", "tcp"), f"rdma over {', '.join(devs)} with GPU memory registration"
    return ("tcp",), f"tcp: no RDMA device in {IB_DIR}; KV is staged through pinned host buffers"


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, index: int = 0) -> None:
        ok, reason = self.availability()
        if not ok:
            raise BackendUnavailable(reason)
        from hwkv_cuda.attention import TritonAttentionBackend
        from hwkv_cuda.device import CudaDevice

        protocols, why = transfer_choice()
        self._caps = Capabilities(
            dtypes=(torch.bfloat16, torch.float16, torch.float32),
            head_sizes=None,
            block_sizes=None,
            block_size_multiple=16,
            max_block_size=256,
            default_block_size=16,
            kv_layouts=(KVLayoutKind.PER_LAYER,),
            transfer_protocols=protocols,
            transfer_reason=why,
            graph_capture=True,
            max_gqa_ratio=64,
            kv_cache_dtypes=("auto", "fp8_e4m3"),  # e4m3 with per-head float32 scales
            extras={"kernels": "triton unified paged attention (split-KV)", "transfer": why},
        )
        self._device = CudaDevice(index)
        self._attention = TritonAttentionBackend()

    def decode_ops(self) -> DecodeOps:
        from hwkv_cuda.decode_ops import TritonDecodeOps

        return TritonDecodeOps()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            if not torch.cuda.is_available():
                build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
                return False, (f"no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__} "
                               f"built for {build}); install a CUDA build of torch on a machine with an NVIDIA GPU")
            import importlib.util

            if importlib.util.find_spec("triton") is None:
                return False, "triton not installed: pip install triton (it ships with CUDA builds of torch)"
        except Exception as e:  # availability never raises
            return False, f"CUDA probe failed: {e!r}"
        _, why = transfer_choice()
        return True, f"transfer: {why}"

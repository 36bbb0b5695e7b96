"""The CUDA backend: torch.cuda device, Triton attention, Mooncake transfer (rdma or tcp staging)."""

from __future__ import annotations

import os
from typing import Any

import torch

from hwkv.interfaces.backend import Backend, BackendUnavailable
from hwkv.interfaces.capabilities import Capabilities
from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.interfaces.layout import KVLayoutKind
from hwkv.interfaces.transfer import Transfer

IB_DIR = "/sys/class/infiniband"


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir(IB_DIR))
    except OSError:
        return []


def transfer_choice() -> tuple[tuple[str, ...], str]:
    """``cuda_ipc`` first (device-direct between the GPUs and processes of one host: CUDA IPC
    handles, NVLink/PCIe copies; :mod:`hwkv_cuda.ipc`), then ``rdma`` (GPU memory registered,
    GPUDirect, across hosts) when RDMA devices exist, else ``tcp`` staged through pinned host
    buffers; those two need the Mooncake wheel."""
    from hwkv.transfer.mooncake import NOT_INSTALLED, engine_installed

    ipc = "cuda_ipc: device-direct between processes/GPUs of one host (CUDA IPC handles, NVLink or PCIe)"
    if not engine_installed():
        return ("cuda_ipc",), f"{ipc}; across hosts none: {NOT_INSTALLED}"
    devs = rdma_devices()
    if devs:
        return ("cuda_ipc", "rdma", "tcp"), f"{ipc}; rdma over {', '.join(devs)} with GPU memory registration"
    return ("cuda_ipc", "tcp"), f"{ipc}; tcp: no RDMA device in {IB_DIR}; KV is staged through pinned host buffers"


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
            attention_features=("sliding_window", "logit_softcap", "attention_sinks"),
            extras={"kernels": "triton unified paged attention (split-KV)", "transfer": why},
        )
        self._device = CudaDevice(index)
        self._attention = TritonAttentionBackend()

    def decode_ops(self) -> DecodeOps:
        from hwkv_cuda.decode_ops import TritonDecodeOps

        return TritonDecodeOps()

    def elementwise_ops(self) -> Any:  # hwkv.interfaces.elementwise_ops.ElementwiseOps | None
        from hwkv_cuda.elementwise import elementwise_ops

        return elementwise_ops()

    def create_transfer(self, **options: Any) -> Transfer:
        """``protocol="cuda_ipc"`` (the default): a same-host device-direct endpoint on this backend's
        GPU (options: ``host``, ``timeout_s``, ``method``, ``streams``; :mod:`hwkv_cuda.ipc`); other
        protocols: Mooncake TransferEngine as the base class does."""
        options.setdefault("protocol", self._caps.transfer_protocols[0])
        if options["protocol"] != "cuda_ipc":
            return super().create_transfer(**options)
        from hwkv.transfer.direct import DirectTransfer
        from hwkv_cuda.ipc import CudaIpcMover

        options.pop("protocol")
        mover = CudaIpcMover(options.pop("device", self._device.torch_device), method=options.pop("method", "auto"),
                             streams=options.pop("streams", 2))
        return DirectTransfer(mover, **options)

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

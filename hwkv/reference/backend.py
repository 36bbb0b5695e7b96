"""The CPU reference backend: host device, pure-torch attention, same-host ``cma`` transfer, TCP when Mooncake is
installed."""

from __future__ import annotations

import torch

from hwkv.interfaces.backend import Backend
from hwkv.interfaces.capabilities import Capabilities
from hwkv.interfaces.layout import KVLayoutKind
from hwkv.reference.attention import ReferenceAttentionBackend
from hwkv.reference.device import CpuDevice
from hwkv.transfer.mooncake import NOT_INSTALLED, engine_installed


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        tcp = engine_installed()
        self._caps = Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            head_sizes=None,
            block_sizes=None,
            block_size_multiple=1,
            max_block_size=256,
            default_block_size=16,
            kv_layouts=(KVLayoutKind.PER_LAYER,),
            # cma: same-host direct copies between processes (hwkv.transfer.direct), no Mooncake needed;
            # tcp (Mooncake) across hosts, and the fallback where cross-memory attach is not permitted
            transfer_protocols=("cma", "tcp") if tcp else ("cma",),
            transfer_reason="" if tcp else f"tcp: {NOT_INSTALLED}",
            graph_capture=False,
            kv_cache_dtypes=("auto", "fp8_e4m3"),  # e4m3 with per-head float32 scales
            attention_features=("sliding_window", "logit_softcap", "attention_sinks"),
        )
        self._device = CpuDevice()
        self._attention = ReferenceAttentionBackend()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, ""

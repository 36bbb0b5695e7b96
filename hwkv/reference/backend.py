"""The CPU reference backend: host device, pure-torch attention, TCP transfer when Mooncake is installed."""

from __future__ import annotations

import importlib.machinery
import importlib.util

import torch

from hwkv.interfaces.backend import Backend
from hwkv.interfaces.capabilities import Capabilities
from hwkv.interfaces.layout import KVLayoutKind
from hwkv.reference.attention import ReferenceAttentionBackend
from hwkv.reference.device import CpuDevice

MOONCAKE_MISSING = "mooncake-transfer-engine not installed: pip install 'hwkv[mooncake]'"


def mooncake_engine_installed() -> bool:
    """Whether ``mooncake.engine`` can be imported, without importing (or executing) anything."""
    try:
        pkg = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return False
    if pkg is None or not pkg.submodule_search_locations:
        return False
    return importlib.machinery.PathFinder.find_spec("engine", list(pkg.submodule_search_locations)) is not None


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self) -> None:
        tcp = mooncake_engine_installed()
        self._caps = Capabilities(
            dtypes=(torch.float32, torch.float16, torch.bfloat16),
            head_sizes=None,
            block_sizes=None,
            block_size_multiple=1,
            max_block_size=256,
            default_block_size=16,
            kv_layouts=(KVLayoutKind.PER_LAYER,),
            transfer_protocols=("tcp",) if tcp else (),
            transfer_reason="" if tcp else MOONCAKE_MISSING,
            graph_capture=False,
        )
        self._device = CpuDevice()
        self._attention = ReferenceAttentionBackend()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, ""

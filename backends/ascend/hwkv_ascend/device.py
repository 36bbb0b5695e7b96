"""AscendDevice: one NPU through ``torch_npu.npu`` (memory, streams, events, ACL graphs, pinned host
staging).

ACL graphs follow vllm-ascend's capture: ``torch.npu.NPUGraph()`` captured under
``torch.npu.graph(graph, pool=..., stream=...)`` with a pool from ``torch.npu.graph_pool_handle()``;
whether the engine uses them is the backend's ``Capabilities.graph_capture`` declaration.

``torch.npu`` is ``torch_npu.npu`` once torch_npu is imported; calling it through the module we
resolved keeps the backend working under the test emulator, where tensors live on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from hwkv.interfaces import Device, KVCache, KVCacheSpec, KVLayoutKind, Stream
from hwkv_ascend import _npu

TRANSFER_ALIGNMENT = 2 * 1024 * 1024  # HCCS / Mooncake-ascend register KV at 2 MiB granularity


def visible_devices() -> list[str] | None:
    """Physical ids listed in ``ASCEND_RT_VISIBLE_DEVICES`` (None when unset)."""
    env = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if env is None:
        return None
    return [d.strip() for d in env.split(",") if d.strip()]


class AscendDevice(Device):
    """One NPU. ``index`` is the logical id *after* ``ASCEND_RT_VISIBLE_DEVICES`` remapping (the CANN
    runtime applies the variable; we only validate the index and report the physical id).

    ``kv_alignment`` > 0 makes ``allocate_kv_cache`` start every KV tensor at a multiple of it: a
    transfer engine registering the cache needs 2 MiB alignment (set by the backend when transfer
    is enabled).
    """

    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self, index: int = 0, kv_alignment: int = 0):
        super().__init__(index)
        self.npu = _npu.torch_npu()
        self.emulated = _npu.is_emulated(self.npu)
        self.type = "cpu" if self.emulated else "npu"
        count = int(self.npu.npu.device_count())
        if not 0 <= index < count:
            vis = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
            raise ValueError(
                f"device index {index} out of range: {count} NPU(s) visible"
                + (f" (ASCEND_RT_VISIBLE_DEVICES={vis!r})" if vis is not None else "")
            )
        if kv_alignment < 0 or (kv_alignment & (kv_alignment - 1)):
            raise ValueError(f"kv_alignment must be 0 or a power of two, got {kv_alignment}")
        self.kv_alignment = kv_alignment
        self.async_copies = not self.emulated  # the emulator's "NPU" memory is the host's
        if not self.emulated:
            self.npu.npu.set_device(index)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.emulated else torch.device("npu", self.index)

    @property
    def name(self) -> str:
        return f"npu:{self.index}"

    @property
    def physical_id(self) -> str:
        vis = visible_devices()
        return vis[self.index] if vis and self.index < len(vis) else str(self.index)

    def description(self) -> str:
        try:
            model = str(self.npu.npu.get_device_name(self.index))
        except Exception:
            model = "Ascend NPU"
        tag = " [emulated on CPU]" if self.emulated else ""
        return f"{model} (soc {_npu.soc_family(self.npu)}, physical id {self.physical_id}){tag}"

    def memory_info(self) -> tuple[int, int]:
        free, total = self.npu.npu.mem_get_info(self.index)
        return int(free), int(total)

    # -- KV allocation -----------------------------------------------------------------------------

    def allocate_kv_cache(self, spec: KVCacheSpec, layout: KVLayoutKind, host: bool = False) -> KVCache:
        if host or not self.kv_alignment:
            return super().allocate_kv_cache(spec, layout, host)
        return KVCache(spec, layout, self._aligned_arena(spec.tensor_shapes(layout), spec.dtype))

    def _aligned_arena(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        """Every KV tensor a view of one zeroed allocation, each starting on an alignment boundary:
        the whole cache registers as one HCCS region (HCCL allows 256 per process)."""
        item = torch.empty((), dtype=dtype).element_size()
        sizes = [torch.Size(s).numel() * item for s in shapes]
        a = self.kv_alignment
        steps = [-(-n // a) * a for n in sizes]
        raw = torch.zeros(sum(steps) + a, dtype=torch.uint8, device=self.torch_device)
        off = -raw.data_ptr() % a  # over-allocated by one unit: slice at the first aligned address
        out = []
        for shape, n, step in zip(shapes, sizes, steps):
            out.append(raw[off : off + n].view(dtype).view(shape))
            off += step
        return out

    # -- streams / events --------------------------------------------------------------------------

    def new_stream(self) -> Stream:
        return self.npu.npu.Stream(device=self.torch_device)

    def current_stream(self) -> Stream:
        return self.npu.npu.current_stream(self.torch_device)

    def stream_context(self, stream: Stream) -> AbstractContextManager[Any]:
        return self.npu.npu.stream(stream)

    def new_event(self, enable_timing: bool = False) -> Any:
        return self.npu.npu.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        self.npu.npu.synchronize(self.torch_device)

    def empty_cache(self) -> None:
        self.npu.npu.empty_cache()

    # -- ACL graphs --------------------------------------------------------------------------------

    def graph_pool(self) -> Any:
        return self.npu.npu.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], Any], pool: Any, stream: Stream) -> tuple[Any, Any]:
        g = self.npu.npu.NPUGraph()
        with self.npu.npu.graph(g, pool=pool, stream=stream):
            out = fn()
        return g, out

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.npu.npu.manual_seed_all(seed)

"""CUDA device: torch.cuda memory, streams and events, CUDA graphs, pinned host staging, batched block
copies, L2 weight prefetch."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from hwkv.interfaces.device import Device, Stream
from hwkv.interfaces.layout import KVCache

COPY_CHUNK = 4096  # elements per program of the block-copy kernel


PREFETCH_PROGRAMS = 32  # few enough to leave the SMs to the GEMM running beside it
PREFETCH_BLOCK = 2048  # int32 per program per iteration (8 KiB)


class CudaDevice(Device):
    type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    supports_prefetch = True
    async_copies = True
    pins_host_in_place = True

    def __init__(self, index: int = 0):
        super().__init__(index)
        self._side: torch.cuda.Stream | None = None
        self._sink: torch.Tensor | None = None

    def pin_host_memory(self, t: torch.Tensor) -> None:
        """``cudaHostRegister`` of ``t``'s storage (its pages are touched and locked now: seconds for
        tens of GB); ``cudaHostUnregister`` once the storage is freed."""
        import weakref

        if t.device.type != "cpu":
            raise ValueError(f"pin_host_memory: {t.device} tensor (allowed: host tensors)")
        if t.is_pinned():
            return
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        rt = torch.cuda.cudart()
        rc = rt.cudaHostRegister(ptr, n, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of {n} B failed: {rc} (host memory locked: ulimit -l, RAM)")
        weakref.finalize(st, rt.cudaHostUnregister, ptr)

    def description(self) -> str:
        p = torch.cuda.get_device_properties(self.index)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, sm_{p.major}{p.minor})"

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.torch_device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.torch_device)

    def stream_context(self, stream: Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def new_event(self, enable_timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=enable_timing)

    def graph_event(self) -> torch.cuda.Event:
        # external: under capture, record and wait become graph nodes (cudaEventWaitExternal)
        # instead of a dependency inside the graph; created by one record, as a wait on a never
        # recorded torch event is skipped, also during capture
        ev = torch.cuda.Event(external=True)
        ev.record()
        return ev

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture_graph(self, fn: Callable[[], Any], pool: Any, stream: Stream) -> tuple[torch.cuda.CUDAGraph, Any]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):  # type: ignore[arg-type]
            out = fn()
        return g, out

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def prefetch(self, tensors: list[torch.Tensor]) -> None:
        """Read ``tensors`` into L2 (evict-last) on a side stream that starts after the work queued
        so far; :meth:`join_prefetch` joins it. Graph-capturable (fork/join through events)."""
        from hwkv_cuda.kernels.prefetch import prefetch_kernel

        if self._side is None:
            self._side = torch.cuda.Stream(self.torch_device)
            self._sink = torch.zeros(PREFETCH_PROGRAMS, dtype=torch.int32, device=self.torch_device)
        self._side.wait_stream(torch.cuda.current_stream(self.torch_device))
        with torch.cuda.stream(self._side):
            for t in tensors:
                flat = t.detach().reshape(-1)
                if (flat.numel() * flat.element_size()) % 4 == 0 and flat.is_contiguous():
                    flat = flat.view(torch.uint8).view(torch.int32)
                else:
                    continue  # odd-sized tensors are not worth a kernel
                prefetch_kernel[(PREFETCH_PROGRAMS,)](flat, self._sink, flat.numel(), BLOCK=PREFETCH_BLOCK,
                                                      num_warps=4)

    def join_prefetch(self) -> None:
        if self._side is not None:
            torch.cuda.current_stream(self.torch_device).wait_stream(self._side)

    def custom_all_reduce(self, comm: Any) -> Any:
        """One-shot push / one-shot / two-shot all-reduce over NVLink peer memory by message size,
        NCCL above (:mod:`hwkv_cuda.allreduce`); ``None`` where peer memory is unavailable."""
        from hwkv_cuda.allreduce import make_custom_all_reduce

        return make_custom_all_reduce(comm)

    def profile_peak_memory(self, fn: Callable[[], Any]) -> int:
        """Peak bytes allocated while ``fn`` runs (a profiling forward), for KV sizing by the engine."""
        torch.cuda.synchronize(self.index)
        torch.cuda.reset_peak_memory_stats(self.index)
        base = torch.cuda.memory_allocated(self.index)
        fn()
        torch.cuda.synchronize(self.index)
        return int(torch.cuda.max_memory_allocated(self.index) - base)

    def copy_blocks(self, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]],
                    stream: Stream | None = None) -> None:
        """One Triton launch per tensor for every direction: pinned host memory is reached through
        unified addressing, so device<->host copies are as stream-ordered as in-device ones."""
        idx = self.check_copy(src, dst, pairs)
        if idx is None:
            return
        with torch.cuda.stream(stream) if stream is not None else _null():  # type: ignore[arg-type]
            if _one_launch(src, dst, idx, self.torch_device):  # its plan checked pinning once for the pair
                return
        for t in (*src.tensors, *dst.tensors):  # is_pinned: a driver query per tensor (~10 us each)
            if t.device.type == "cpu" and not t.is_pinned():
                raise ValueError("copy_blocks to or from the host needs pinned host KV (allocate_kv_cache(host=True))")
        if all(t.device.type == "cpu" for t in (*src.tensors, *dst.tensors)):
            return super().copy_blocks(src, dst, pairs, stream)
        from hwkv_cuda.kernels.cache import copy_blocks_kernel

        with torch.cuda.stream(stream) if stream is not None else _null():  # type: ignore[arg-type]
            # the caching host allocator keeps the pinned index alive until its H2D copy is done
            pairs_dev = idx.pin_memory().to(self.torch_device, non_blocking=True)
            for s_t, d_t in zip(src.tensors, dst.tensors):
                unit = _unit_dtype(s_t)
                elems = s_t[0].numel() * s_t.element_size() // unit.itemsize
                grid = (len(pairs), -(-elems // COPY_CHUNK))
                try:
                    copy_blocks_kernel[grid](s_t.view(unit), d_t.view(unit), pairs_dev, elems, CHUNK=COPY_CHUNK)
                except (ValueError, RuntimeError):
                    if s_t.is_cuda and d_t.is_cuda:
                        raise
                    _copy_runs(s_t, d_t, pairs)  # a Triton that refuses host pointers: merged-run copies


def _one_launch(src: KVCache, dst: KVCache, idx: torch.Tensor, where: torch.device) -> bool:
    """Every tensor's blocks in ONE launch (:func:`copy_blocks_tensors_kernel`) where all tensors have
    blocks of one size and sit at 16-byte multiples from the first (a staging cache in one
    allocation, a device cache's tensors); ``False``: not done, copy per tensor. A restart's load lands
    a piece of every layer from each holder client's thread: one launch instead of one per tensor (32
    at 8B) keeps those threads from queueing on the GIL. ``HWKV_CUDA_COPY_LAUNCH=tensor`` turns it off
    (the A/B of ``hwkv bench pool-restart``)."""
    if os.environ.get("HWKV_CUDA_COPY_LAUNCH", "one") == "tensor" or len(src.tensors) < 2:
        return False
    plan = _launch_plan(src, dst)
    if plan is None:
        return False
    from hwkv_cuda.kernels.cache import copy_blocks_tensors_kernel

    offs, unit, elems = plan
    # one index for the launch: each tensor's (source, destination) offset in 16-byte units, then the
    # pairs; the caching host allocator keeps the pinned copy alive until its H2D copy is done
    table = torch.cat([offs, idx.reshape(-1)]).pin_memory().to(where, non_blocking=True)
    n = len(src.tensors)
    try:
        copy_blocks_tensors_kernel[(len(idx), n, -(-elems // COPY_CHUNK))](
            src.tensors[0].view(unit), dst.tensors[0].view(unit), table, table[2 * n:], elems,
            CHUNK=COPY_CHUNK, PER_16=16 // unit.itemsize)
    except (ValueError, RuntimeError):
        if src.tensors[0].is_cuda and dst.tensors[0].is_cuda:
            raise
        return False  # a Triton that refuses host pointers: per tensor, then merged-run copies
    return True


def _launch_plan(src: KVCache, dst: KVCache) -> tuple[torch.Tensor, torch.dtype, int] | None:
    """``(offsets, unit dtype, elements per block)`` for :func:`_one_launch`, or ``None`` where it does
    not apply (also host to host, and unpinned host memory); remembered per (source, destination) pair -
    a load lands many pieces between the same two caches, and checking 2 x 32 tensors (sizes, offsets,
    pinning: a driver query each) costs up to a millisecond of host time each piece."""
    memo = src.__dict__.setdefault("_hwkv_cuda_launch_plans", {})
    hit = memo.get(id(dst))
    if hit is not None and hit[0]() is dst:
        return hit[1]
    ts, td = src.tensors, dst.tensors
    host = [t for t in (*ts, *td) if t.device.type == "cpu"]
    if len(host) == len(ts) + len(td) or not all(t.is_pinned() for t in host):
        memo[id(dst)] = (weakref.ref(dst), None)  # host to host, or unpinned (copy_blocks says why)
        return None
    unit = _unit_dtype(ts[0])
    nbytes = ts[0].stride(0) * ts[0].element_size()
    ok = all(t.is_contiguous() and t.stride(0) * t.element_size() == nbytes and _unit_dtype(t) == unit
             for t in (*ts, *td))
    offs = [(a.data_ptr() - ts[0].data_ptr(), b.data_ptr() - td[0].data_ptr()) for a, b in zip(ts, td)]
    ok = ok and not any(o % 16 for pair in offs for o in pair) and ts[0].data_ptr() % 16 == 0 \
        and td[0].data_ptr() % 16 == 0
    plan = (torch.tensor(offs, dtype=torch.long).reshape(-1) // 16, unit, nbytes // unit.itemsize) if ok else None
    memo[id(dst)] = (weakref.ref(dst), plan)
    return plan


def _copy_runs(s_t: torch.Tensor, d_t: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    from hwkv.interfaces.layout import group_concurrent_contiguous

    for s0, d0, n in group_concurrent_contiguous([p[0] for p in pairs], [p[1] for p in pairs]):
        d_t[d0:d0 + n].copy_(s_t[s0:s0 + n], non_blocking=True)


def _unit_dtype(t: torch.Tensor) -> torch.dtype:
    nbytes = t[0].numel() * t.element_size()
    return torch.int32 if nbytes % 4 == 0 else torch.uint8


class _null(AbstractContextManager[None]):
    def __exit__(self, *exc: object) -> None:
        return None

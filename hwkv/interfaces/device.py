"""Device interface: memory, KV allocation, streams/events, graphs, host staging, block copies.

The engine reaches the accelerator's runtime only through these methods, so the same step loop
serves every chip: a backend that declares ``Capabilities.graph_capture`` implements
:meth:`Device.graph_pool` / :meth:`Device.capture_graph`; one whose device copies asynchronously
(``async_copies``) gets pinned staging and non-blocking copies from the defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch

from hwkv.interfaces.capabilities import NotSupported
from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind


class Event(Protocol):
    """Device event with torch.cuda.Event semantics."""

    def record(self, stream: Stream | None = None) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Stream(Protocol):
    """Device stream with torch.cuda.Stream semantics."""

    def synchronize(self) -> None: ...
    def wait_event(self, event: Event) -> None: ...
    def wait_stream(self, stream: Stream) -> None: ...


class Graph(Protocol):
    """A captured sequence of device work (torch.cuda.CUDAGraph / torch.npu.NPUGraph semantics)."""

    def replay(self) -> None:
        """Re-run the captured work on the current contents of the tensors it read, writing the
        same output tensors the capture returned; ordered on the current stream, no host sync."""
        ...


T = TypeVar("T")


class Device(ABC):
    """One accelerator (or the host, for the reference backend).

    Contract:
    * ``allocate_kv_cache`` returns zero-filled, contiguous, block-major tensors of ``spec`` in
      ``layout`` on this device; ``host=True`` allocates a pinned host mirror (offload tier).
    * ``copy_blocks(src, dst, pairs)`` copies block ``s`` of every tensor of ``src`` to block ``d``
      of the same tensor of ``dst`` for each ``(s, d)``; caches must share layout and spec except
      ``num_blocks`` (an offload tier holds more or fewer blocks than the device); either may live
      on the host. It is batched (no per-block launch) and ordered on ``stream`` (the
      current stream by default); callers synchronise through events. Destinations are distinct,
      and within one cache no block is both a source and a destination (copies run in parallel);
      :meth:`check_copy` enforces this.
    * ``prefetch(tensors)`` is a hint (``supports_prefetch``): start pulling tensors that are about
      to be read (the next layer's weights) into the device's cache, concurrently with the work
      already queued. Results never depend on it. Work it queues is joined back into the current
      stream by ``join_prefetch()``, which the caller runs before its forward ends (a CUDA-graph
      capture needs every side stream joined). The defaults do nothing.
    * Host staging: with ``async_copies`` (the device has its own memory and copy engines),
      :meth:`host_empty` returns page-locked buffers, and :meth:`to_device` / :meth:`to_host_async`
      copy without blocking the host; a staging buffer may be rewritten only after the copy that
      read it completed (an event recorded after it has fired). Without it (the host is the
      device) the same calls are plain, synchronous and zero-copy where possible.
    * Graphs (only where the backend declares ``Capabilities.graph_capture``; the defaults raise
      :class:`NotSupported`): :meth:`capture_graph` runs ``fn`` once under capture on ``stream``
      and returns a :class:`Graph` plus ``fn``'s result, whose tensors every replay rewrites.
      Graphs captured with one :meth:`graph_pool` share memory, so they must replay one at a
      time (capture the largest first). ``fn`` must not synchronise with the host; every side
      stream it forks must be joined back before it returns.
    """

    type: str = "cpu"
    dist_backend: str = "gloo"  # torch.distributed backend of tensor parallelism (Communicator)
    # env var restricting a process to some of the host's devices (tensor-parallel workers get one
    # each, so every rank's device is index 0); None: the device is the host
    visible_devices_env: str | None = None
    supports_prefetch: bool = False
    async_copies: bool = False  # host<->device copies run asynchronously from pinned host memory
    # pin_host_memory page-locks plain host memory in place (else host memory for copies is pinned
    # when allocated)
    pins_host_in_place: bool = False

    def __init__(self, index: int = 0):
        self.index = index

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type, self.index) if self.type != "cpu" else torch.device("cpu")

    @property
    def name(self) -> str:
        return f"{self.type}:{self.index}"

    @abstractmethod
    def description(self) -> str:
        """Human-readable model of the device (for reports)."""

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)``."""

    def allocate_kv_cache(self, spec: KVCacheSpec, layout: KVLayoutKind, host: bool = False) -> KVCache:
        if host:
            return KVCache.allocate(spec, layout, "cpu", pin_memory=self.async_copies)
        return KVCache.allocate(spec, layout, self.torch_device)

    def pin_host_memory(self, t: torch.Tensor) -> None:
        """Page-lock the host tensor ``t`` (allocated unpinned) in place, for asynchronous copies with
        this device; unpinned again when ``t`` is freed. Only where ``pins_host_in_place``; a no-op
        without ``async_copies`` (the host is the device)."""
        if self.async_copies and not t.is_pinned():
            raise NotImplementedError(f"{self.type}: host memory cannot be pinned in place (allocate it pinned)")

    # ---- host staging --------------------------------------------------------------------------
    def host_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging buffer: page-locked with ``async_copies``, plain host memory otherwise."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.async_copies)

    def host_zeros(self, shape: tuple[int, ...] | int, dtype: torch.dtype) -> torch.Tensor:
        return self.host_empty(shape, dtype).zero_()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        """A page-locked host uint8 buffer (plain host memory where pinning is meaningless)."""
        return self.host_empty(nbytes, torch.uint8)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a host tensor the caller will not write again) on this device: the same tensor
        when the device is the host; else staged through pinned memory from torch's caching host
        allocator (a block is reused only after the copy that read it completed) and copied without
        blocking the host."""
        if host.device == self.torch_device:
            return host
        if self.async_copies and not host.is_pinned():
            host = host.pin_memory()
        return host.to(self.torch_device, non_blocking=self.async_copies)

    def to_host_async(self, t: torch.Tensor) -> tuple[torch.Tensor, Event | None]:
        """Start copying device tensor ``t`` to the host: ``(host tensor, event)``; the host tensor
        is valid once ``event`` has fired (``None``: valid at once) and is never ``t`` itself (a graph's
        static output is rewritten by its next replay while the copy is still to be read)."""
        if not self.async_copies:
            return t.to("cpu", copy=True), None
        host = self.host_empty(tuple(t.shape), t.dtype)
        host.copy_(t, non_blocking=True)
        event = self.new_event()
        event.record()
        return host, event

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the runtime (benchmarks between engines)."""
        return None

    @abstractmethod
    def new_stream(self) -> Stream: ...

    @abstractmethod
    def current_stream(self) -> Stream: ...

    @abstractmethod
    def stream_context(self, stream: Stream) -> AbstractContextManager[None]: ...

    @abstractmethod
    def new_event(self, enable_timing: bool = False) -> Event:
        """An event; ``enable_timing=True`` gives ``elapsed_time(end)`` in milliseconds."""

    def graph_event(self) -> Event | None:
        """An event that a captured graph may wait on: a wait recorded during capture becomes part
        of the graph, and each replay waits for the event's latest record made before the replay
        was launched (a connector's per-layer load events). ``None`` where the device cannot; the
        default: a plain event on a device that captures no graphs (every wait runs eagerly)."""
        return self.new_event() if type(self).capture_graph is Device.capture_graph else None

    @abstractmethod
    def synchronize(self) -> None: ...

    # ---- graphs (Capabilities.graph_capture) ---------------------------------------------------
    def graph_pool(self) -> Any:
        """A memory-pool handle that graphs captured with it share."""
        raise _no_graphs(self)

    def capture_graph(self, fn: Callable[[], T], pool: Any, stream: Stream) -> tuple[Graph, T]:
        """Capture ``fn`` on ``stream`` into a graph using ``pool`` (see class contract)."""
        raise _no_graphs(self)

    def custom_all_reduce(self, comm: Any) -> Any:
        """A faster all-reduce for tensor parallelism over ``comm`` (a
        :class:`~hwkv.interfaces.communicator.Communicator`), as a
        :data:`~hwkv.interfaces.communicator.CustomAllReduce`; ``None`` (the default): the
        communicator's own. Called once per group on every rank, after the group is up (a
        collective: every rank calls it, so a rendezvous inside it is allowed). ``comm`` may also
        offer ``store`` (a ``torch.distributed`` store private to this group), ``group_name``
        (unique among the process's groups) and ``torch_group`` (the group's torch.distributed
        backend object) for the backend's own rendezvous; without them a backend returns ``None``.
        A returned object with ``close()`` is closed with the group."""
        return None

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def prefetch(self, tensors: list[torch.Tensor]) -> None:
        """Cache hint for ``tensors`` (see class contract); default: nothing."""
        return None

    def join_prefetch(self) -> None:
        """Make the current stream wait for the queued prefetches; default: nothing."""
        return None

    @staticmethod
    def check_copy(src: KVCache, dst: KVCache, pairs: list[tuple[int, int]]) -> torch.Tensor | None:
        """Validate a ``copy_blocks`` request; the ``[n, 2]`` int64 pairs, or ``None`` when empty."""
        if replace(src.spec, num_blocks=1) != replace(dst.spec, num_blocks=1) or src.layout != dst.layout:
            raise ValueError("copy_blocks needs caches of the same layout and spec (num_blocks aside)")
        if not pairs:
            return None
        idx = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        for side, col, nb in (("source", 0, src.spec.num_blocks), ("destination", 1, dst.spec.num_blocks)):
            if int(idx[:, col].min()) < 0 or int(idx[:, col].max()) >= nb:
                raise IndexError(f"{side} block ids must lie in [0, {nb})")
        dsts = idx[:, 1].tolist()
        if len(set(dsts)) != len(dsts):
            raise ValueError("copy_blocks: a destination block appears twice")
        if src is dst and not set(dsts).isdisjoint(idx[:, 0].tolist()):
            raise ValueError("copy_blocks within one cache: a block is both a source and a destination")
        return idx

    def copy_blocks(
        self, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]], stream: Stream | None = None
    ) -> None:
        """Batched block copy (see class contract). One indexed copy per tensor."""
        idx = self.check_copy(src, dst, pairs)
        if idx is None:
            return
        s_idx, d_idx = idx[:, 0], idx[:, 1]
        ctx = self.stream_context(stream) if stream is not None else _nullcontext()
        with ctx:
            for s_t, d_t in zip(src.tensors, dst.tensors):
                s_t, d_t = _as_bytes(s_t), _as_bytes(d_t)
                si = s_idx.to(s_t.device, non_blocking=True)
                di = d_idx.to(d_t.device, non_blocking=True)
                # A non-blocking device->host copy returns before the bytes land, and the host-side
                # index_copy_ that follows is on no stream: it must wait.
                to_host = d_t.device.type == "cpu" and s_t.device.type != "cpu"
                d_t.index_copy_(0, di, s_t.index_select(0, si).to(d_t.device, non_blocking=not to_host))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (the same bytes): torch has no index_copy_ for float8 on the CPU, so an
    fp8 KV cache's copies failed there (the offload tier silently stored nothing)."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def _no_graphs(dev: Device) -> Exception:
    return NotSupported(f"device {dev.name} captures no graphs (Capabilities.graph_capture is False)")


class _nullcontext(AbstractContextManager[None]):
    def __exit__(self, *exc: object) -> None:
        return None

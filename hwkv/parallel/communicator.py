"""TorchDistCommunicator: the :class:`~hwkv.interfaces.communicator.Communicator` over a
``torch.distributed`` process group of the backend's ``Device.dist_backend`` (gloo / nccl / hccl).

The group is built straight from its backend class (``ProcessGroupGloo``, ``ProcessGroupNCCL``, or
the creator a plugin such as torch_npu registered for ``hccl``) over a store, **not** as
torch.distributed's default group: a process may hold several groups at once, one per
tensor-parallel engine, and create and drop them in any order. Each group lives under its own
prefix (``group``) of a rendezvous ``TCPStore`` on 127.0.0.1: rank 0 opens it on a free port the OS
picks (no pick-then-bind race), the other ranks connect to that port. Every wait — joining, each
collective — is bounded by ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hwkv.interfaces.communicator import Communicator, CustomAllReduce

_store: Any = None
_store_lock = threading.Lock()
_groups = itertools.count()


def open_store(world_size: int | None = None, timeout_s: float = 300.0) -> Any:
    """A new rendezvous store on a free loopback port (``.port`` tells which), this process its master."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def process_store(timeout_s: float = 300.0) -> Any:
    """This process's rendezvous store, opened once and shared by every group it leads (each under
    its own prefix, :func:`new_group_name`): dropping an engine leaves no listening socket behind
    per engine, however many are created."""
    global _store
    with _store_lock:
        if _store is None:
            _store = open_store(None, timeout_s)
        return _store


def new_group_name() -> str:
    """A group name unique among this process's groups (and across processes on the host)."""
    return f"hwkv-tp-{os.getpid()}-{next(_groups)}"


def _make_group(backend: str, store: Any, rank: int, size: int, timeout: timedelta, device: torch.device) -> Any:
    """The torch.distributed backend object of one group (its collectives return a ``Work``)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        if hasattr(opts, "is_high_priority_stream"):
            opts.is_high_priority_stream = False
        torch.cuda.set_device(device)  # the communicator binds to the current device at its first collective
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    plugin = dist.Backend._plugins.get(backend.upper())  # registered with dist.Backend.register_backend
    if plugin is None:
        raise ValueError(f"torch.distributed backend {backend!r} is not available (allowed: gloo, nccl, or a backend "
                         "registered through torch.distributed.Backend.register_backend, e.g. torch_npu's hccl)")
    if getattr(plugin, "extended_api", False):
        raise ValueError(f"torch.distributed backend {backend!r} registered with the extended API is not supported")
    return plugin.creator_fn(store, rank, size, timeout)


class TorchDistCommunicator(Communicator):
    def __init__(self, device: Any, rank: int, world_size: int, port: int, timeout_s: float = 300.0,
                 store: Any = None, group: str = "hwkv-tp"):
        """Join group ``group`` (rank 0 passes the master ``store`` — :func:`open_store` or
        :func:`process_store`; the others connect to its ``port``). Blocks until all ``world_size``
        ranks joined or ``timeout_s`` passed. Then asks the backend for its custom all-reduce
        (``device.custom_all_reduce(self)``), which may use ``store`` (this group's prefix of the
        rendezvous store) and ``group_name`` for a rendezvous of its own."""
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, None, is_master=False, timeout=timeout)
        self.rank, self.world_size = rank, world_size
        self.device = device.torch_device
        self.backend_name = device.dist_backend
        self.group_name = group
        # the MLP halves' overlap of prefill all-reduces (Communicator.overlap_tokens); HWKV_TP_OVERLAP_TOKENS
        self.overlap_tokens = int(os.environ.get("HWKV_TP_OVERLAP_TOKENS", "0") or 0)
        self.store = dist.PrefixStore(group + "/", store)
        self._root = store  # keeps a client connection open for as long as the group lives
        self._pg: Any = _make_group(self.backend_name, dist.PrefixStore("pg/", self.store), rank, world_size, timeout,
                                    self.device)
        self._custom: CustomAllReduce | None = None
        try:
            self._custom = device.custom_all_reduce(self)
        except BaseException:  # nobody holds this object to close(): leave no group behind
            self.close()
            raise

    @property
    def torch_group(self) -> Any:
        """This group's torch.distributed backend object (``ProcessGroupNCCL``, ...), for a
        backend's own rendezvous (``Device.custom_all_reduce``); ``None`` once closed."""
        return self._pg

    @property
    def custom_all_reduce(self) -> CustomAllReduce | None:
        """The backend's custom all-reduce (``Device.custom_all_reduce``) or ``None``: a backend's
        decode ops may run the all-reduce inside their kernels over its buffers (``DecodeOps.rank_sum``)."""
        return self._custom

    def _group(self) -> Any:
        if self._pg is None:
            raise RuntimeError(f"communicator {self.group_name!r} is closed")
        return self._pg

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._custom is not None and self._custom(t) is not None:
            return t
        self._group().allreduce([t]).wait()
        return t

    def all_reduce_start(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        start = getattr(self._custom, "all_reduce_start", None)
        if start is not None and (wait := start(t)) is not None:  # the backend's, beside what follows
            return wait
        if self._custom is not None and self._custom(t) is not None:
            return lambda: t
        work = self._group().allreduce([t])  # on the group's own stream (NCCL), after what is enqueued here

        def wait() -> torch.Tensor:
            work.wait()
            return t

        return wait

    def all_reduce_add(self, t: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        add = getattr(self._custom, "all_reduce_add", None)
        if add is not None and (out := add(t, residual)) is not None:
            return out
        return self.all_reduce(t).add_(residual)

    def all_reduce_add_rms_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        fused = getattr(self._custom, "all_reduce_add_rms_norm", None)
        return fused(t, residual, weight, eps) if fused is not None else None

    def all_reduce_add_rms_norm_start(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                      eps: float) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
        start = getattr(self._custom, "all_reduce_add_rms_norm_start", None)
        return start(t, residual, weight, eps) if start is not None else None

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        gather = getattr(self._custom, "all_gather", None)
        if gather is not None and (out := gather(t, dim)) is not None:
            return out
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self._group().allgather([parts], [t.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._group().broadcast([t], opts).wait()
        return t

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._group().allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        custom, self._custom = self._custom, None
        if custom is not None and hasattr(custom, "close"):
            with contextlib.suppress(Exception):
                custom.close()
        pg, self._pg = self._pg, None
        if pg is not None and self.backend_name == "nccl" and torch.cuda.is_available():
            # the collectives already enqueued (a last async step) finish before the abort (bounded: a
            # peer that died mid-collective must not hang the close)
            _bounded(lambda: torch.cuda.synchronize(self.device), CLOSE_WAIT_S)
        if pg is not None and os.environ.get("HWKV_NCCL_CLOSE", "abort") == "keep" and self.backend_name == "nccl":
            # kept, never torn down (the process exit reclaims it): a stuck abort on a thread of its own
            # may block the next group's start (batch 2 of 2026-11-28: the second tp=2 engine of a
            # process never came up after the first's abort was left running) - the A/B of that
            _KEPT_GROUPS.append(pg)
            pg = None
        if pg is not None:
            # NCCL: abort (local, never waits). Its shutdown finalizes with the peers, and a peer that is
            # gone (a worker the driver has terminated) can leave it waiting forever
            names = ("abort", "shutdown") if self.backend_name == "nccl" else ("shutdown", "abort")
            shutdown = getattr(pg, names[0], None) or getattr(pg, names[1], None)
            if shutdown is not None:
                # NCCL's abort did not return at all on 2 x H200 (bf27901: not even with the peer still
                # alive): waiting longer only makes every close slower
                _bounded(shutdown, ABORT_WAIT_S if self.backend_name == "nccl" else CLOSE_WAIT_S)
        self.store = self._root = None


CLOSE_WAIT_S = 5.0
ABORT_WAIT_S = 1.0
_KEPT_GROUPS: list[Any] = []  # HWKV_NCCL_CLOSE=keep: closed groups held until the process exits


def _bounded(fn: Any, wait_s: float) -> None:
    """``fn()`` on a daemon thread, waited for at most ``wait_s``: an NCCL abort after the peers left
    did not return on 2 x H200 (ed3398d, a tp=2 engine's close), and a close must not hang its caller;
    what it leaves is the process's to reclaim at exit."""

    def run() -> None:
        with contextlib.suppress(Exception):
            fn()

    t = threading.Thread(target=run, name="hwkv-comm-close", daemon=True)
    t.start()
    t.join(wait_s)
    if t.is_alive():
        import warnings

        warnings.warn(f"communicator close did not return within {wait_s:.0f} s; left to the process exit",
                      stacklevel=3)

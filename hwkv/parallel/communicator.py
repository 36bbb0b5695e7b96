"""TorchDistCommunicator: the :class:`~hwkv.interfaces.communicator.Communicator` over
``torch.distributed`` with the backend's ``Device.dist_backend`` (gloo / nccl / hccl).

Rendezvous is a ``TCPStore`` on 127.0.0.1: rank 0 opens it on a free port the OS picks (no
pick-then-bind race) and hands the port to the other ranks; every wait — joining, each collective —
is bounded by ``timeout_s``. One group per process (torch's default group): a second
tensor-parallel engine in the same process must wait until the first one is closed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hwkv.interfaces.communicator import Communicator, CustomAllReduce


def open_store(world_size: int, timeout_s: float) -> Any:
    """Rank 0's rendezvous store on a free loopback port (``.port`` tells which)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TorchDistCommunicator(Communicator):
    def __init__(self, device: Any, rank: int, world_size: int, port: int, timeout_s: float = 300.0,
                 store: Any = None):
        """Join the group (rank 0 passes the ``store`` of :func:`open_store`; the others its
        ``port``). Blocks until all ``world_size`` ranks joined or ``timeout_s`` passed."""
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised in this process (one tensor-parallel "
                               "engine per process: close() the other first)")
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        self.rank, self.world_size = rank, world_size
        self.device = device.torch_device
        backend = device.dist_backend
        kw: dict[str, Any] = {}
        if backend != "gloo" and self.device.type != "cpu":  # bind the group to this rank's device (eager
            # NCCL/HCCL init); torch takes only an accelerator here (an emulated one lives on the CPU)
            kw["device_id"] = self.device
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kw)
        self._store = store
        self._custom: CustomAllReduce | None = None
        try:
            self._custom = device.custom_all_reduce(self)
        except BaseException:  # nobody holds this object to close(): leave no group behind
            self.close()
            raise

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self._custom is not None and self._custom(t) is not None:
            return t
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(t, src)
        return t

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

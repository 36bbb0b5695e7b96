"""An in-process tensor-parallel group for tests: ``N`` ranks as threads of one process, with a
:class:`~hwkv.interfaces.communicator.Communicator` per rank over shared memory. Lets a test hold
every rank's model shard and KV cache at once (e.g. heterogeneous-TP KV transfer) without worker
processes. Results follow the contract: identical on every rank, reductions summed in rank order."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from hwkv.interfaces.communicator import Communicator


class ThreadGroup:
    def __init__(self, size: int, timeout_s: float = 60.0):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout_s)
        self._slots: list[Any] = [None] * size

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone read it
        return values

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """``[fn(0), ..., fn(size - 1)]``, each rank in its own thread; re-raises the first error."""
        out: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(r: int) -> None:
            try:
                out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


class ThreadComm(Communicator):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        vals = self.group.exchange(self.rank, t.clone())
        acc = vals[0].clone()
        for v in vals[1:]:
            acc += v
        return t.copy_(acc)

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, t.clone()), dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t.copy_(self.group.exchange(self.rank, t.clone())[src])

    def all_reduce_min(self, value: int) -> int:
        return min(self.group.exchange(self.rank, value))

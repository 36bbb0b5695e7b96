"""Connectors for tensor-parallel tests: built by name (``"hwkv.testing.tp_connectors:FailingRank"``)
in every rank's process, so a failure can be injected on one rank only."""

from __future__ import annotations

import time
from typing import Any

from hwkv.connectors.offload import OffloadConnector
from hwkv.connectors.offload.worker import OffloadWorker
from hwkv.connectors.p2p import P2PConnector
from hwkv.connectors.p2p.consumer import _Load
from hwkv.connectors.p2p.worker import P2PWorker


class FailingRankWorker(OffloadWorker):
    fail_rank, fails = 1, 1

    def load_blocks(self, host_ids: list[int], device_ids: list[int], layer: int | None = None) -> None:
        if self.tp_rank == self.fail_rank and self.fails:
            self.fails -= 1
            raise RuntimeError(f"injected load failure on rank {self.tp_rank}")
        super().load_blocks(host_ids, device_ids, layer)


class FailingRank(OffloadConnector):
    """The offload connector whose host-tier loads fail to issue ``fails`` times on rank ``fail_rank``
    only (a transfer error on one shard), then work."""

    worker_cls = FailingRankWorker

    def __init__(self, fail_rank: int = 1, fails: int = 1, **kw: Any):
        super().__init__(**kw)
        self.worker.fail_rank, self.worker.fails = fail_rank, fails


class FailingP2PRankWorker(P2PWorker):
    fail_rank, fails = 1, 1

    def start_loads(self, loads: list[Any]) -> None:
        if self.tp_rank == self.fail_rank and self.fails and loads:
            self.fails -= 1
            for spec in loads:  # as a transfer error would: reported failed, the blocks settled
                self._reading[spec.rid] = _Load(spec, time.monotonic() + 3 * self.config.transfer_timeout_s)
                self._done("recv", spec.rid, False, 0)
            return
        super().start_loads(loads)


class FailingP2PRank(P2PConnector):
    """The p2p connector whose transfers into rank ``fail_rank`` fail (a read or push that errors on
    one consumer shard) ``fails`` times."""

    worker_cls = FailingP2PRankWorker

    def __init__(self, fail_rank: int = 1, fails: int = 1, **kw: Any):
        super().__init__(**kw)
        self.worker.fail_rank, self.worker.fails = fail_rank, fails

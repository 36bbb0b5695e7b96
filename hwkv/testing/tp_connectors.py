"""Connectors for tensor-parallel tests: built by name (``"hwkv.testing.tp_connectors:FailingRank"``)
in every rank's process, so a failure can be injected on one rank only."""

from __future__ import annotations

from typing import Any

from hwkv.connectors.offload import OffloadConnector


class FailingRank(OffloadConnector):
    """The offload connector whose host-tier loads fail to issue ``fails`` times on rank ``fail_rank``
    only (a transfer error on one shard), then work."""

    def __init__(self, fail_rank: int = 1, fails: int = 1, **kw: Any):
        super().__init__(**kw)
        self.fail_rank, self.fails = fail_rank, fails

    def load_blocks(self, host_ids: list[int], device_ids: list[int]) -> None:
        if self.tp_rank == self.fail_rank and self.fails:
            self.fails -= 1
            raise RuntimeError(f"injected load failure on rank {self.tp_rank}")
        super().load_blocks(host_ids, device_ids)

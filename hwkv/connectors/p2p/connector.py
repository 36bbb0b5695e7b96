"""Prefill/decode disaggregation: the ``p2p`` connector moves a prompt's KV from a prefill engine
(``role="producer"``) to a decode engine (``role="consumer"``) over a :class:`~hwkv.interfaces.transfer.Transfer`
(the first protocol both offer that works between them: device-direct ``cuda_ipc`` on one host,
Mooncake ``rdma`` across hosts, ``tcp`` staging anywhere), in one of two modes
(docs/disaggregation.md walks through both):

* ``mode="pull"`` (vllm-ascend's Mooncake connector): the producer keeps the prompt's blocks after
  prefill (``delay_free``) and returns where they are in ``kv_transfer_params``; the consumer
  allocates blocks, READs the producer's into them, and tells the producer to free its copy.
* ``mode="push"`` (vLLM's Mooncake connector): the consumer allocates blocks and sends their ids to
  the producer, which WRITEs its blocks into them and notifies the consumer.

Both sides pin the blocks a transfer touches until it has really ended (a consumer whose load
timed out recomputes, but its blocks stay pinned until the transfer stops). Every wait is bounded:
a dead peer becomes a failed load (the consumer recomputes: identical tokens) or an expired hold
(the producer frees the blocks after ``hold_timeout_s``).

Transport (the protocols offered and chosen at the handshake, transfer endpoints, tcp staging,
side-channel dispatch):
:mod:`hwkv.connectors.p2p.transport`.

Two sides (vLLM v1's role split, NixlConnector's shape): :class:`~hwkv.connectors.p2p.scheduler.P2PScheduler`
(offers, pins, holds, the per-step :class:`~hwkv.connectors.p2p.state.P2PMeta`; no I/O) and
:class:`~hwkv.connectors.p2p.worker.P2PWorker` (transfer engines, side channel, every transfer).
They share the checked :class:`~hwkv.connectors.p2p.state.P2PConfig` and, on the driver, the
:class:`~hwkv.connectors.p2p.state.DriverState` (the producer's holds, which the scheduler side
creates and the driver's side channel serves, under one lock).

Tensor parallelism (docs/disaggregation.md): the scheduler side and the side channel run on the
driver; every rank registers its KV shard with its own transfer engine and reports its layout
(``tp_worker_info``), so the producer's handshake reply lists every rank's. Each consumer rank
gets the head slices :func:`~hwkv.connectors.p2p.protocol.read_plan` gives it (producer and
consumer may differ in tp where one size divides the other): it reads them (pull), or the producer
ranks holding them write them (push, :mod:`hwkv.connectors.p2p.push`); the producer frees a
request's blocks once every consumer rank was served.
"""

from __future__ import annotations

from typing import Any

from hwkv.connectors.base.roles import SplitConnector
from hwkv.connectors.p2p.protocol import Layout
from hwkv.connectors.p2p.scheduler import P2PScheduler
from hwkv.connectors.p2p.state import MODES, ROLES, DriverState, P2PConfig, P2PMeta
from hwkv.connectors.p2p.worker import P2PWorker

__all__ = ["MODES", "ROLES", "P2PConnector"]


class P2PConnector(SplitConnector):
    """``kv_connector="p2p"``: the configuration and the two sides (a test injects failures by
    naming a worker subclass in ``worker_cls``)."""

    name = "p2p"
    worker_cls: type[P2PWorker] = P2PWorker
    scheduler: P2PScheduler
    worker: P2PWorker
    # tensor parallelism: the scheduler side and the side channel run on the driver, which knows every
    # rank's layout; each consumer rank gets its heads itself, and the producer frees a request's
    # blocks once every consumer rank was served
    supports_tensor_parallel = True
    metadata_type = P2PMeta | None
    # a load's blocks are unpinned once no rank's transfer can write them; a staged hold is served
    # once every rank staged its shard
    tp_job_keys = ("p2p_settled", "p2p_staged")
    # KV-cache groups (docs/hybrid-models.md): every group's blocks move (a window group's live window
    # only); the groups travel in the handshake's layout and a mismatch is refused naming both sides
    supports_kv_groups = True
    tp_sending_from_driver = True
    tp_worker_info_type = Layout

    def __init__(self, role: str, mode: str = "pull", host: str = "127.0.0.1", side_channel_port: int = 0,
                 protocol: str = "auto", metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
                 transfer_timeout_s: float = 10.0, hold_timeout_s: float = 60.0, staging: bool | None = None,
                 layerwise: bool = False, part_tokens: int = 1024):
        config = P2PConfig(role, mode, host, side_channel_port, protocol, metadata_server, device_name,
                           transfer_timeout_s, hold_timeout_s, staging, layerwise, part_tokens)
        state = DriverState()
        self.scheduler = P2PScheduler(config, state)
        self.worker = self.worker_cls(config, state)

    @property
    def config(self) -> P2PConfig:
        return self.worker.config

    # ---- set-up: what both sides need ----------------------------------------------------------
    def bind_model(self, model: str, model_config: Any = None) -> None:
        self.worker.bind_model_config(model_config)

    def bind_backend(self, backend: Any) -> None:
        self.worker.bind_backend(backend)

    def check_tensor_parallel(self, size: int) -> None:
        self.config.check_tensor_parallel(size)

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.worker.register_kv_caches(kv_cache)
        self.scheduler.bind_worker(staging=self.worker.host_kv is not None)

"""The p2p connector's transport: which protocol moves the KV, the transfer engine that registers
it, tcp staging through a pinned host mirror of the device pool, and the side channel's message
dispatch (on the channel's own thread).

State lives on :class:`~hwkv.connectors.p2p.connector.P2PConnector`; this mixin holds the transport logic.
"""

from __future__ import annotations

from typing import Any

from hwkv.connectors.base.copy import copy_block_pairs
from hwkv.connectors.p2p.channel import SideChannel
from hwkv.connectors.p2p.protocol import (
    Ack,
    Acquire,
    Hello,
    HelloReply,
    PushDone,
    PushOrder,
    PushPart,
    PushRequest,
    Release,
    incompatibility,
    layout_of,
)


class TransportSide:
    # ---- set-up --------------------------------------------------------------------------------
    def _resolve_protocol(self, on_host: bool) -> str:
        declared = self._backend_protocols
        if self.protocol != "auto":
            if declared and self.protocol not in declared and not (self.protocol == "tcp" and on_host):
                raise ValueError(f"p2p: protocol {self.protocol!r} is not offered by the backend (allowed: "
                                 f"{', '.join(declared)}, or 'auto')")
            return self.protocol
        if declared:  # the backend's preference: rdma/ascend where its devices register memory directly
            return declared[0]
        if on_host:
            return "tcp"
        raise ValueError(f"p2p: the backend declares no transfer protocol ({self._backend_reason or 'none'})")

    def register_kv_caches(self, kv_cache: Any) -> None:
        from hwkv.transfer.mooncake import MooncakeTransfer

        on_host = kv_cache.device.type == "cpu"
        self.protocol = self._resolve_protocol(on_host)
        staging = (not on_host and self.protocol == "tcp") if self.staging is None else bool(self.staging)
        if not on_host and self.protocol == "tcp" and not staging:
            raise ValueError(f"p2p: protocol 'tcp' moves host memory but the KV cache is on {kv_cache.device} "
                             "(allowed: staging=True or None, or protocol 'rdma' / 'ascend' for device memory)")
        self.kv_cache = kv_cache
        if staging:  # tcp from a device: through a pinned host mirror of the pool (same block ids)
            self.host_kv = self.dev.allocate_kv_cache(kv_cache.spec, kv_cache.layout, host=True)
        if staging and self.layerwise:
            raise ValueError("p2p: layerwise=True needs KV the transfer engine reaches directly (host memory, or "
                             "rdma/ascend device memory), not tcp staging (allowed: layerwise=False)")
        if self.tp_size > 1:
            self.check_tensor_parallel(self.tp_size)
        xfer = self.host_kv if staging else kv_cache
        self.transfer = MooncakeTransfer(protocol=self.protocol, host=self.host, metadata_server=self.metadata_server,
                                         device_name=self.device_name, timeout_s=self.transfer_timeout_s)
        for t in xfer.tensors:
            self.transfer.register(t.data_ptr(), t.numel() * t.element_size())
        # the driver's; in push mode every rank's too (a producer rank takes write orders, a consumer
        # rank its PushDone); in pull mode the other ranks only read (consumer) or are read (producer)
        if self.tp_rank == 0 or self.mode == "push":
            self.channel = SideChannel(self.host, self.port if self.tp_rank == 0 else 0, self._handle)
        self.layout = layout_of(xfer, self.engine_id, self.transfer.endpoint(), self.protocol,
                                tp_rank=self.tp_rank, tp_size=self.tp_size, total_kv_heads=self.total_kv_heads,
                                side_channel=self.channel.address if self.channel is not None else "")
        self.rank_layouts = [self.layout]  # the driver learns the other ranks' in bind_tp_worker_info

    def _stage(self, to_host: bool, block_ids: list[int]) -> None:
        """Staging: copy ``block_ids`` between the device pool and its host mirror, and wait for it."""
        src, dst = (self.kv_cache, self.host_kv) if to_host else (self.host_kv, self.kv_cache)
        stream = self.dev.current_stream()  # behind the forwards that wrote (or will read) the blocks
        copy_block_pairs(self.dev, src, dst, block_ids, block_ids, stream)
        ev = self.dev.new_event()
        ev.record(stream)
        ev.synchronize()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.transfer is not None:
            self.transfer.close()
            self.transfer = None

    # ---- side channel (its own thread) ---------------------------------------------------------
    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, Hello):
            why = incompatibility(self.layout, msg.layout)  # type: ignore[arg-type]
            if not why and msg.layout.tp_size != self.tp_size and self.layerwise:
                why = (f"layerwise push needs equal tensor-parallel sizes (tp={self.tp_size} here, tp="
                       f"{msg.layout.tp_size} at engine {msg.layout.engine_id}; allowed: layerwise=False)")
            if why:
                return HelloReply(None, why)
            with self._lock:
                self._peers[msg.layout.engine_id] = msg.layout
            return HelloReply(self.layout, layouts=self.rank_layouts)
        if isinstance(msg, Acquire):
            return self.accept_acquire(msg)
        if isinstance(msg, Release):
            return self.accept_release(msg)
        if isinstance(msg, PushRequest):
            return self.accept_push(msg)
        if isinstance(msg, PushOrder):
            return self.accept_order(msg)
        if isinstance(msg, PushPart):
            return self._part_done(msg)
        if isinstance(msg, PushDone):
            self._done("recv", msg.request_id, msg.ok, msg.nbytes, msg.settled)
            return Ack(True)
        return Ack(False, f"unexpected message {type(msg).__name__}")

    def _done(self, kind: str, rid: str, ok: bool, nbytes: int, settled: bool = True) -> None:
        self._results.put((kind, rid, ok, nbytes, settled))
        self._wake.set()


"""The p2p connector's transport: which protocol moves the KV, the transfer engine that registers
it, tcp staging through a pinned host mirror of the device pool, and the side channel's message
dispatch (on the channel's own thread).

A mixin of :class:`~hwkv.connectors.p2p.worker.P2PWorker`, whose ``__init__`` declares the state it uses.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from hwkv.connectors.base.copy import copy_block_pairs
from hwkv.connectors.p2p.channel import SideChannel
from hwkv.connectors.p2p.protocol import (
    Ack,
    Acquire,
    Hello,
    HelloReply,
    Layout,
    PushDone,
    PushOrder,
    PushPart,
    PushRequest,
    Release,
    incompatibility,
    layout_of,
)
from hwkv.interfaces.layout import KVCache
from hwkv.transfer.direct import DIRECT_PROTOCOLS, host_identity
from hwkv.transfer.mooncake import MooncakeTransfer

log = logging.getLogger(__name__)
HOST_PROTOCOLS = ("cma",)  # move host memory only
DEVICE_PROTOCOLS = ("cuda_ipc", "rdma", "ascend")  # move device memory


class Transport:
    # ---- set-up --------------------------------------------------------------------------------
    def _protocols_offered(self, on_host: bool) -> list[str]:
        """The protocols this engine offers peers, in preference order: ``protocol="auto"`` takes the
        backend's declared order (device-direct first), else the given one or comma-separated list;
        each kept only where it moves the memory the KV lives in."""
        declared = list(self._backend_protocols or ())
        if self.config.protocol == "auto":
            wanted = declared or (["tcp"] if on_host else [])
            if not wanted:
                raise ValueError(f"p2p: the backend declares no transfer protocol ({self._backend_reason or 'none'})")
        else:
            wanted = [p.strip() for p in str(self.config.protocol).split(",") if p.strip()]
            for p in wanted:
                if declared and p not in declared and not (p == "tcp" and on_host):
                    raise ValueError(f"p2p: protocol {p!r} is not offered by the backend (allowed: "
                                     f"{', '.join(declared)}, a comma-separated list of them, or 'auto')")
        if self.config.staging:
            wanted = [p for p in wanted if p == "tcp"] or ["tcp"]
        dropped = {}
        offers = []
        for p in wanted:
            if p in HOST_PROTOCOLS and not on_host:
                dropped[p] = "moves host memory, the KV cache is on the device"
            elif p in DEVICE_PROTOCOLS and on_host:
                dropped[p] = "moves device memory, the KV cache is in host memory"
            elif p == "tcp" and not on_host and self.config.staging is False:
                dropped[p] = "would stage device KV through host memory (staging=False)"
            elif p == "tcp" and self.layerwise and (not on_host or self.config.staging) and offers:
                dropped[p] = "layerwise writes need memory the transfer reaches directly"
            elif p not in offers:
                offers.append(p)
        if not offers:
            raise ValueError(f"p2p: no transfer protocol fits a KV cache in {'host' if on_host else 'device'} memory "
                             f"({'; '.join(f'{k}: {v}' for k, v in dropped.items())}; allowed: staging=True or None "
                             "for tcp from a device, or rdma / ascend / cuda_ipc for device memory)")
        return offers

    def _create_transfer(self, protocol: str) -> Any:
        if protocol in DIRECT_PROTOCOLS:
            if self._backend is None:
                raise ValueError(f"p2p: protocol {protocol!r} needs the backend (bind_backend) to create it")
            return self._backend.create_transfer(protocol=protocol, host=self.config.host,
                                                  timeout_s=self.config.transfer_timeout_s)
        if protocol in DEVICE_PROTOCOLS and self._backend is not None and protocol in (self._backend_protocols or ()):
            # the backend's own endpoint for its device fabric: Ascend's names the NPU as Mooncake's
            # device_name (vllm-ascend passes the NPU id; "" would leave HCCS without a device) and
            # refuses registrations past HCCL's per-process limit with a reason
            opts = {"protocol": protocol, "host": self.config.host, "metadata_server": self.config.metadata_server,
                    "timeout_s": self.config.transfer_timeout_s}
            if self.config.device_name:
                opts["device_name"] = self.config.device_name
            return self._backend.create_transfer(**opts)
        return MooncakeTransfer(protocol=protocol, host=self.config.host, metadata_server=self.config.metadata_server,
                                device_name=self.config.device_name, timeout_s=self.config.transfer_timeout_s)

    def register_kv_caches(self, kv_cache: Any) -> None:
        on_host = kv_cache.device.type == "cpu"
        offers = self._protocols_offered(on_host)
        if self.tp_size > 1:
            self.config.check_tensor_parallel(self.tp_size)
            if self.config.protocol == "auto" and offers[0] == "cuda_ipc" and len(offers) > 1:
                # a tensor-parallel rank sees only its own GPU (CUDA_VISIBLE_DEVICES), and CUDA IPC maps
                # memory only onto visible GPUs; not verified across ranks, so auto does not bet every
                # request on it (no fallback across ranks): protocol="cuda_ipc" asks for it
                log.info("p2p: tensor-parallel engine: auto skips cuda_ipc, uses %s", offers[1])
                offers = offers[1:]
            offers = offers[:1]  # every rank's layout travels for one protocol only (no fallback across ranks)
        staging = "tcp" in offers and (not on_host or bool(self.config.staging))
        if staging and self.layerwise and offers[0] == "tcp":
            raise ValueError("p2p: layerwise=True needs KV the transfer engine reaches directly (host memory, or "
                             "rdma/ascend/cuda_ipc device memory), not tcp staging (allowed: layerwise=False)")
        self.kv_cache = kv_cache
        if staging:  # tcp from a device: through a pinned host mirror of the pool (same block ids)
            self.host_kv = self._mirror(kv_cache, fallback=offers[0] != "tcp")
        self.transports, self.layouts = {}, {}
        for p in offers:
            xfer = self.host_kv if (p == "tcp" and staging) else kv_cache
            t = None
            try:
                t = self._create_transfer(p)
                by_backend = getattr(self._backend, "register_kv_cache", None) if p in DEVICE_PROTOCOLS else None
                if by_backend is not None and p not in DIRECT_PROTOCOLS:
                    for c in getattr(xfer, "caches", [xfer]):  # KV-cache groups: each group's cache
                        by_backend(t, c)  # as few regions as the fabric needs (HCCL: at most 256 per process)
                else:
                    for tensor in xfer.tensors:
                        t.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())
            except Exception as e:
                if t is not None:
                    t.close()
                if p == offers[-1] and not self.transports:
                    raise
                log.warning("p2p: protocol %s unavailable here, not offered (%s: %s)", p, type(e).__name__, e)
                continue
            self.transports[p] = (t, xfer)
        # the driver's; in push mode every rank's too (a producer rank takes write orders, a consumer
        # rank its PushDone); in pull mode the other ranks only read (consumer) or are read (producer)
        if self.tp_rank == 0 or self.config.mode == "push":
            port = self.config.side_channel_port if self.tp_rank == 0 else 0
            self.channel = SideChannel(self.config.host, port, self._handle)
        host_id = host_identity()
        for p, (t, xfer) in self.transports.items():
            self.layouts[p] = layout_of(xfer, self.engine_id, t.endpoint(), p, tp_rank=self.tp_rank,
                                        tp_size=self.tp_size, total_kv_heads=self.total_kv_heads,
                                        side_channel=self.channel.address if self.channel is not None else "",
                                        host_id=host_id)
        self.protocol = next(iter(self.transports))
        self.transfer, self.layout = self.transports[self.protocol][0], self.layouts[self.protocol]
        self.state.rank_layouts = [self.layout]  # the driver learns the other ranks' in bind_tp_worker_info
        log.info("p2p %s: offers %s", self.config.role, ", ".join(self.transports))

    def transfer_for(self, protocol: str) -> tuple[Any, Layout]:
        """This engine's transfer endpoint and layout for ``protocol`` (the handshake's choice)."""
        if protocol not in self.transports:
            raise RuntimeError(f"p2p: protocol {protocol!r} is not offered here (offered: "
                               f"{', '.join(self.transports)})")
        return self.transports[protocol][0], self.layouts[protocol]

    def usable(self, mine: Layout, theirs: Layout) -> str:
        """Why this engine cannot copy to/from ``theirs`` over its protocol ("" when it can): the
        layouts must translate, and a same-host protocol needs the peer on this host and a probe that
        reads its memory."""
        why = incompatibility(mine, theirs)
        if why or theirs.protocol not in DIRECT_PROTOCOLS:
            return why
        if theirs.host_id != mine.host_id:
            return (f"{theirs.protocol} needs both engines on one host (engine {theirs.engine_id} is on "
                    f"{theirs.host_id or 'an unknown host'}, this one on {mine.host_id})")
        try:
            self.transports[theirs.protocol][0].probe(theirs.endpoint)
        except Exception as e:
            return f"{theirs.protocol} probe of engine {theirs.engine_id} failed: {e}"
        return ""

    def _mirror(self, kv_cache: Any, fallback: bool) -> Any:
        """The host mirror tcp staging copies through. Behind a device-direct protocol (tcp only as the
        fallback for peers it cannot reach) it is plain host memory, untouched (no resident pages)
        until a peer falls back, and pinned in place then (:meth:`_pin_mirror`): a pool of tens of
        GB is not page-locked in every engine for a path that may never run. KV-cache groups: a
        mirror of each group's cache (the same block ids per group)."""
        caches = getattr(kv_cache, "caches", None)
        if caches is not None:
            mirrors = [self._mirror_one(c, fallback) for c in caches]
            self._mirror_pinned = all(pinned for _, pinned in mirrors)
            return type(kv_cache)(kv_cache.groups, [m for m, _ in mirrors])
        mirror, self._mirror_pinned = self._mirror_one(kv_cache, fallback)
        return mirror

    def _mirror_one(self, kv_cache: KVCache, fallback: bool) -> tuple[KVCache, bool]:
        if not (fallback and self.dev.async_copies and self.dev.pins_host_in_place):
            mirror, pinned = self.dev.allocate_kv_cache(kv_cache.spec, kv_cache.layout, host=True), True
        else:
            spec, layout = kv_cache.spec, kv_cache.layout
            mirror = KVCache(spec, layout, [torch.empty(s, dtype=spec.dtype) for s in spec.tensor_shapes(layout)])
            pinned = False
        mirror.scales = kv_cache.scales  # fp8 KV: the mirror's codes mean what the device's do
        return mirror, pinned

    def _pin_mirror(self) -> None:
        if self._mirror_pinned:
            return
        with self._mirror_lock:  # the first fallback pins it; a concurrent one waits for that
            if self._mirror_pinned:
                return
            t0 = time.perf_counter()
            for t in self.host_kv.tensors:
                self.dev.pin_host_memory(t)
            self._mirror_pinned = True
            n = sum(t.numel() * t.element_size() for t in self.host_kv.tensors)
            log.warning("p2p: a peer uses tcp staging: pinned the %.1f GB host mirror in %.1f s", n / 1e9,
                        time.perf_counter() - t0)

    def stage_for(self, protocol: str, h: Any) -> None:
        """A hold read or written over tcp while the KV is on the device: copy its blocks to the host
        mirror first, once (at tp=1 when the first tcp peer needs them; tensor-parallel ranks stage
        theirs at the step after the prefill, and the hold is host-staged then)."""
        if protocol != "tcp" or self.host_kv is None or h.host_staged:
            return
        with self._stage_lock:  # two consumer ranks may ask at once: one copy
            if not h.host_staged:
                self._stage(True, h.all_block_ids)
                h.host_staged = True

    def _stage(self, to_host: bool, block_ids: list[list[int]]) -> None:
        """Staging: copy ``block_ids`` (one list per KV-cache group) between the device pool and its host
        mirror, and wait for it."""
        self._pin_mirror()
        src, dst = (self.kv_cache, self.host_kv) if to_host else (self.host_kv, self.kv_cache)
        stream = self.dev.current_stream()  # behind the forwards that wrote (or will read) the blocks
        pairs = list(zip(src.caches, dst.caches)) if hasattr(src, "caches") else [(src, dst)]
        for (s, d), ids, g in zip(pairs, block_ids, getattr(src, "groups", [None])):
            if g is not None and g.window is not None:
                ids = [b for b in ids if b]  # a window group's null entries (block 0) hold nothing
            copy_block_pairs(self.dev, s, d, ids, ids, stream)
        ev = self.dev.new_event()
        ev.record(stream)
        ev.synchronize()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        for t, _ in self.transports.values():  # direct endpoints: peers' mappings detached, ours revoked
            t.close()
        self.transports, self.transfer = {}, None

    # ---- side channel (its own thread) ---------------------------------------------------------
    def _handle(self, msg: Any) -> Any:
        if isinstance(msg, Hello):
            return self._hello(msg)
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
            self._done("recv", msg.request_id, msg.ok, msg.nbytes, msg.settled, msg.valid)
            return Ack(True)
        return Ack(False, f"unexpected message {type(msg).__name__}")

    def _hello(self, msg: Hello) -> HelloReply:
        """Pair with a consumer: every one of its layouts whose protocol this engine offers and can use
        (push: this side copies, so device-direct ones are probed here); the consumer picks among them."""
        ok: dict[str, Layout] = {}
        unusable: dict[str, str] = {}
        for lay in [msg.layout, *msg.alternatives]:
            if lay.protocol not in self.layouts:
                unusable[lay.protocol] = f"not offered by engine {self.engine_id} (offers {', '.join(self.layouts)})"
                continue
            mine = self.layouts[lay.protocol]
            why = incompatibility(mine, lay)
            if not why and lay.tp_size != self.tp_size and self.layerwise:
                why = (f"layerwise push needs equal tensor-parallel sizes (tp={self.tp_size} here, tp="
                       f"{lay.tp_size} at engine {lay.engine_id}; allowed: layerwise=False)")
            if not why and self.layerwise and lay.protocol == "tcp" and self.host_kv is not None:
                why = "layerwise writes need memory the transfer reaches directly, not tcp staging"
            if not why and self.config.mode == "push":
                why = self.usable(mine, lay)
            if why:
                unusable[lay.protocol] = why
            else:
                ok[lay.protocol] = lay
        if not ok:
            whys = set(unusable.values())
            why = whys.pop() if len(whys) == 1 else "; ".join(f"{p}: {w}" for p, w in unusable.items())
            return HelloReply(None, why or "no layout given")
        with self.state.lock:
            self._peers[msg.layout.engine_id] = ok
        rest = [lay for p, lay in self.layouts.items() if p != self.protocol] if self.tp_size == 1 else []
        return HelloReply(self.layout, layouts=self.state.rank_layouts, alternatives=rest, unusable=unusable)

    def _done(self, kind: str, rid: str, ok: bool, nbytes: int, settled: bool = True, valid: int = 0) -> None:
        """``valid``: a failed load's first tokens that did land (0: none beyond its local hit)."""
        self._results.put((kind, rid, ok, nbytes, settled, valid))
        self._wake.set()


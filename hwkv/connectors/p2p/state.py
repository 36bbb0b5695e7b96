"""What the p2p connector's two sides share: its validated configuration (:class:`P2PConfig`, both
sides, every rank) and the driver's producer state (:class:`DriverState`: the holds the scheduler
side creates in ``request_finished`` and the driver's side channel serves, under one lock).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from hwkv.connectors.p2p.protocol import Layout, PushRequest

ROLES, MODES = ("producer", "consumer"), ("pull", "push")


class LoadSpec(msgspec.Struct, array_like=True):
    """Per-step metadata: load tokens ``[start, end)`` of the remote request ``params`` names into
    ``block_ids`` (the request's blocks, all of them, in order; pinned by the scheduler side) and, with
    KV-cache groups, ``group_block_ids`` (groups 1.., the same; a window group's entries before its
    window are its null block 0)."""

    rid: str
    params: dict[str, Any]
    block_ids: list[int]
    start: int
    end: int
    group_block_ids: list[list[int]] = []

    @property
    def all_block_ids(self) -> list[list[int]]:
        return [self.block_ids, *self.group_block_ids]


class P2PMeta(msgspec.Struct, array_like=True):
    """One step's work for every rank's worker side (plain data at tp > 1; ``writes`` only at tp=1)."""

    loads: list[LoadSpec]
    writes: list[Any]  # layerwise: (Stream, block ids, start, end) of this step's forwards
    idle: bool  # nothing scheduled: the worker may wait briefly for its side channel
    stage: list[tuple[str, list[list[int]]]]  # tp staging: holds (block ids per group) each rank copies to host
    releases: list[dict[str, Any]]  # kv_transfer_params of remote holds this consumer will not fetch



@dataclass(frozen=True)
class P2PConfig:
    """``kv_connector_config`` of ``p2p``, checked (docs/disaggregation.md lists the keys)."""

    role: str
    mode: str = "pull"
    host: str = "127.0.0.1"
    side_channel_port: int = 0
    protocol: str = "auto"  # asked for: "auto", one protocol or a comma-separated list
    metadata_server: str = "P2PHANDSHAKE"
    device_name: str = ""
    transfer_timeout_s: float = 10.0
    hold_timeout_s: float = 60.0
    staging: bool | None = None
    layerwise: bool = False
    # a load is copied in up to four token-ordered parts of at least this many tokens each (a failed part
    # keeps those before it; every extra part is one more transfer call)
    part_tokens: int = 1024

    def __post_init__(self) -> None:
        role, mode, port = self.role, self.mode, self.side_channel_port
        if role not in ROLES:
            raise ValueError(f"p2p: role={role!r} is invalid (allowed: {', '.join(ROLES)})")
        if mode not in MODES:
            raise ValueError(f"p2p: mode={mode!r} is invalid (allowed: {', '.join(MODES)})")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"p2p: side_channel_port={port!r} is invalid (allowed: 0..65535, 0 = any)")
        for key in ("transfer_timeout_s", "hold_timeout_s"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise ValueError(f"p2p: {key}={v!r} is invalid (allowed: seconds in (0, 3600])")
            object.__setattr__(self, key, float(v))
        pt = self.part_tokens
        if isinstance(pt, bool) or not isinstance(pt, int) or not 1 <= pt <= 1 << 24:
            raise ValueError(f"p2p: part_tokens={pt!r} is invalid (allowed: an int in 1..16777216, the fewest "
                             "tokens of one part of a load)")
        if self.layerwise and (role, mode) != ("producer", "push"):
            raise ValueError(f"p2p: layerwise=True applies to a producer in mode 'push' (got role={role!r}, "
                             f"mode={mode!r}; allowed: layerwise=False elsewhere)")
        object.__setattr__(self, "layerwise", bool(self.layerwise))

    def check_tensor_parallel(self, size: int) -> None:
        if self.layerwise:
            raise ValueError(f"p2p: layerwise=True needs tensor_parallel_size=1 (got {size}; allowed at "
                             "tensor_parallel_size > 1: layerwise=False, mode 'pull' or 'push')")


@dataclass
class Held:
    """A finished request's blocks kept for a consumer."""

    rid: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    group_block_ids: list[list[int]] = field(default_factory=list)  # KV-cache groups 1.. (LoadSpec's)
    digest_of: Any = None  # (prompt ids, salt): checks a consumer-first push names the same prompt
    busy: bool = False  # a push (write) of them is running
    readers: set[int] = field(default_factory=set)  # consumer ranks that acquired them (pull) or asked a push
    staged: bool = True  # tensor-parallel staging: every rank copied them to its host mirror
    waiting: list[Any] = field(default_factory=list)  # pushes asked for before they were staged
    released: set[int] = field(default_factory=set)  # consumer ranks whose read ended / push was answered
    host_staged: bool = False  # in the host mirror (where there is one; else staged when a tcp peer needs it)

    @property
    def all_block_ids(self) -> list[list[int]]:
        return [self.block_ids, *self.group_block_ids]


@dataclass
class Stream:
    """Layerwise push of one request: per-layer writes issued during its forwards."""

    msg: PushRequest
    peer: Layout
    batches: list[int] = field(default_factory=list)
    nbytes: int = 0
    failed: str = ""
    finished: bool = False  # the request finished prefill: once the batches end, notify


@dataclass
class DriverState:
    """The producer's state on the driver, shared by the scheduler side (creates holds and layerwise
    streams, marks holds staged) and the worker side (its side channel serves the holds, its
    ``get_finished`` reports them sent or expired). ``held``, ``targets``, ``target_deadlines`` and
    ``ready`` change only under ``lock`` (the side channel has its own thread)."""

    rank_layouts: list[Layout] = field(default_factory=list)  # every rank's layout; empty until registered
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: dict[str, Held] = field(default_factory=dict)
    targets: dict[str, tuple[PushRequest, Layout]] = field(default_factory=dict)  # transfer id -> consumer-first
    target_deadlines: dict[str, float] = field(default_factory=dict)
    producing: dict[str, Any] = field(default_factory=dict)  # rid -> request carrying a transfer_id, until done
    by_transfer: dict[str, str] = field(default_factory=dict)  # transfer id -> rid
    streams: dict[str, Stream] = field(default_factory=dict)  # rid -> layerwise push in flight
    # pushes the scheduler side released (a staged hold's waiting ones, a consumer-first announcement
    # met by its prefill's end): (push, hold, consumer layout, ok); the worker starts them
    ready: list[tuple[PushRequest, Held, Layout, bool]] = field(default_factory=list)

    def claim(self, h: Held, msg: PushRequest, timeout_s: float) -> None:
        """A push of ``h`` for ``msg``'s consumer rank starts (under ``lock``)."""
        h.busy, h.deadline = True, time.monotonic() + 3 * timeout_s
        h.readers.add(msg.reader)

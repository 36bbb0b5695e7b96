"""Messages between a tensor-parallel driver and its workers: msgspec structs over msgpack, never
pickle (a socket peer must not be able to run code in the other process).

Driver → worker (one PUSH socket per worker): ``Setup`` once, then every call the engine makes on
its runner, in order — ``DecodeOps``, ``Execute`` (one step's scheduler output, without sampling parameters:
workers do not sample), ``Flush``, ``Release``, ``Preempt``, ``Rollback``, ``Graphs``, ``Recapture`` — and
``Shutdown``. Worker → driver (one PULL socket): ``Hello`` once the worker process is up (before
it joins the group, so a worker that cannot start is reported instead of timing out the join),
with a KV connector ``ConnectorInfo`` once after ``Setup`` (its ``tp_worker_info``) and ``KVOut``
after every forward step (its worker side's completions on that rank, merged by the driver), and
``Failed`` when it dies.
"""

from __future__ import annotations

from typing import Any

import msgspec


class WorkerConfig(msgspec.Struct):
    """argv of ``python -m hwkv.engine.tp.worker`` (JSON)."""

    model: str
    backend: str
    dtype: str | None
    max_model_len: int | None
    block_size: int | None
    num_kv_blocks: int | None
    memory_fraction: float
    max_num_seqs: int
    seed: int
    rank: int
    world_size: int
    port: int  # the rendezvous TCPStore on 127.0.0.1
    cmd_addr: str
    out_addr: str
    timeout_s: float
    parent_pid: int
    kv_connector: str | None = None  # a registered name or "package.module:Class"; this rank builds its own
    kv_connector_config: dict[str, Any] = {}
    group: str = "hwkv-tp"  # the engine's group name (its prefix of the rendezvous store)
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str | None = None  # JSON of the engine's kv_cache_scales (over the checkpoint's KV heads)


class Hello(msgspec.Struct, tag=True):
    rank: int
    pid: int


class Failed(msgspec.Struct, tag=True):
    rank: int
    error: str  # the traceback


class Setup(msgspec.Struct, tag=True, array_like=True):
    max_num_seqs: int
    max_model_len: int
    fuse: bool
    # the driver's KV-cache groups (docs/hybrid-models.md) as (layers, window, blocks); []: one group of
    # every layer with the agreed pool. The rank allocates its KV cache from this.
    kv_groups: list[tuple[list[int], int | None, int]] = []


class DecodeOps(msgspec.Struct, tag=True, array_like=True):
    """Whether the driver's model took the backend's fused decode ops (every rank must run the same
    forward: the collectives inside it pair up)."""

    on: bool


class Graphs(msgspec.Struct, tag=True, array_like=True):
    max_batch: int
    use_graphs: bool


class NewReq(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class Execute(msgspec.Struct, tag=True, array_like=True):
    new: list[NewReq]
    cached_ids: list[str]
    cached_new_blocks: list[list[int] | None]
    cached_computed: list[int]
    num_scheduled: list[int]  # batch order: cached, then new
    total: int
    finished: list[str]
    preempted: list[str]
    forward: bool = True  # False: the driver failed applying the state changes; apply them, run nothing
    step: int = 0  # the driver's count of forward steps sent (tags the rank's KVOut)
    kv_meta: bytes | None = None  # the connector's metadata, msgpack (decoded as its metadata_type)
    argmax: bool = False  # every request plain: each rank takes the argmax of its logits, no broadcast
    groups: dict[str, list[list[int]]] = {}  # SchedulerOutput.group_block_ids (KV-cache groups 1..)


class Flush(msgspec.Struct, tag=True, array_like=True):
    pass


class Release(msgspec.Struct, tag=True, array_like=True):
    req_id: str


class Preempt(msgspec.Struct, tag=True, array_like=True):
    req_id: str


class Rollback(msgspec.Struct, tag=True, array_like=True):
    """The driver's step raised after it was sent: forget its sampled tokens (the driver's runner
    keeps the step before it pending)."""


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Profile(msgspec.Struct, tag=True, array_like=True):
    """Start (``path`` empty) or stop a kernel profile of the steps in between
    (:mod:`hwkv.engine.tp.profile`); at stop the rank writes ``<path>.rank<r>.json``."""

    path: str = ""


class Recapture(msgspec.Struct, tag=True, array_like=True):
    """Set ``env`` (``HWKV_`` variables only; an empty value unsets one) and capture the decode graphs of
    ``lo < batch <= hi`` again: A/B runs of kernel and tile variants in one engine (bench tools,
    :func:`hwkv.engine.tp.runner.recapture`). Every rank does it at the same point of the call stream (a capture runs
    the forward's collectives)."""

    env: dict[str, str]
    lo: int
    hi: int


class KVOut(msgspec.Struct, tag=True):
    """A rank's connector output of forward step ``step`` (msgpack of a KVConnectorOutput, or None)."""

    rank: int
    step: int
    output: bytes | None


class ConnectorInfo(msgspec.Struct, tag=True):
    """A rank's ``tp_worker_info()`` (msgpack), sent once after its runner registered the KV cache."""

    rank: int
    info: bytes


ToWorker = (Setup | DecodeOps | Graphs | Execute | Flush | Release | Preempt | Rollback | Shutdown | Profile
            | Recapture)
FromWorker = Hello | Failed | KVOut | ConnectorInfo

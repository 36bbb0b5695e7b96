"""KV-cache events: what a cache tier gained or lost, for routers that place requests by cached prefix.

The schema is vLLM's (``vllm.distributed.kv_events``) field for field and in the same msgpack shape
(array-like structs, events tagged by class name), so a subscriber written for vLLM decodes hwkv's
events unchanged:

* ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)``: blocks
  whose KV the tier now holds, a chain in order; ``parent_block_hash`` is the block before the first
  (``None``: the chain starts at token 0); ``token_ids`` are the blocks' tokens.
* ``BlockRemoved(block_hashes, medium)``: blocks the tier no longer holds (evicted, dropped).
* ``AllBlocksCleared()``: the instance holds nothing in any tier (its publisher's first batch, and
  the head of a snapshot). A prefix-cache reset is a ``BlockRemoved`` of every hash of that tier:
  the event has no ``medium``, and the host and pool tiers keep their blocks.
* ``KVEventBatch(ts, events, data_parallel_rank)``: one step's events, published as one message.

Hashes are hwkv's chained block hashes (``hwkv.core.hashing``: 32-byte sha256 digests, salt and LoRA
folded into the chain), so a router that hashes a request's tokens the same way finds its blocks.
``medium`` names the tier: ``"GPU"`` the engine's device KV cache (vLLM's name for it, whatever the
accelerator), ``"CPU"`` the host offload tier, ``"POOL"`` the shared pool.

Core code appends these to plain lists (``BlockPool.kv_events``); publishing (ZMQ, sequence numbers,
replay) lives in :mod:`hwkv.engine.kv_events`.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_POOL = "POOL"

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the KV-cache events (tagged by class name in the encoding)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def apply_events(index: set, events: list[Any], medium: str | None = None) -> None:
    """Apply ``events`` (of ``medium`` only, when given) to ``index``, a set of block hashes: the
    reference semantics a subscriber's index follows."""
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            index.clear()
        elif medium is not None and ev.medium != medium:
            continue
        elif isinstance(ev, BlockStored):
            index.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            index.difference_update(ev.block_hashes)

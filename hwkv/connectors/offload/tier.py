"""The offload connector's host tier: host KV blocks keyed by the device prefix cache's block hashes.

A :class:`HostTier` is a :class:`~hwkv.core.block_pool.BlockPool` of host blocks, so a host hit is a
prefix-cache hit one tier down (same chained hashes, salts included) and the pool's LRU free queue
is the tier's eviction order. Its invariants, which the connector keeps and the tests check:

* a block with ``ref_cnt > 0`` is *pinned* — by a pending hit, a load reading it or a store writing
  it — and is neither evicted nor counted as capacity; every pin is released exactly once;
* a hash is registered only once the bytes under it have landed (:meth:`publish`), so a lookup
  never returns a block whose store is still in flight;
* one hash maps to at most one block; registered blocks not pinned are in LRU order (a lookup hit,
  a store that finds the block already there, or a released pin moves it to the MRU end).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import TYPE_CHECKING

from hwkv.core.block_pool import BlockPool, KVCacheBlock
from hwkv.core.kv_events import BlockStored

if TYPE_CHECKING:
    from hwkv.interfaces.layout import KVCacheSpec

_is_block = partial(is_not, None)


@dataclass(frozen=True)
class HostTierGeometry:
    """What both sides of the connector know of the tier: the worker allocates ``num_blocks`` host
    blocks of the device cache's shape, the scheduler keys that many by hash."""

    num_blocks: int
    block_size: int  # tokens per block, as the device cache's
    bytes_per_block: int  # all layers of one block (one tensor-parallel shard's)

    @classmethod
    def of(cls, spec: KVCacheSpec, cpu_bytes: int) -> HostTierGeometry:
        """The most blocks of ``spec``'s shape ``cpu_bytes`` hold; ``ValueError`` when none fits."""
        n = cpu_bytes // spec.bytes_per_block
        if n < 1:
            raise ValueError(f"offload: cpu_bytes={cpu_bytes} holds no KV block (one block of all layers is "
                             f"{spec.bytes_per_block} bytes; allowed: cpu_bytes >= {spec.bytes_per_block})")
        return cls(n, spec.block_size, spec.bytes_per_block)


class HostTier(BlockPool):
    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, enable_caching=True)

    def match(self, hashes: Iterable[bytes]) -> list[KVCacheBlock]:
        """The blocks holding ``hashes`` consecutively from the first (a miss ends the match, as a
        hash chains its whole prefix). Not pinned: :meth:`touch` what will be read."""
        return list(takewhile(_is_block, map(self.cached_block_hash_to_block.get, hashes)))

    def refresh(self, block_hash: bytes) -> bool:
        """Move the block holding ``block_hash`` to the MRU end (a pinned one gets there when its
        last pin is released); False when the tier does not hold it."""
        block = self.cached_block_hash_to_block.get(block_hash)
        if block is None:
            return False
        self.touch((block,))
        self.free_blocks((block,))
        return True

    def refresh_all(self, hashes: list[bytes]) -> list[bool]:
        """:meth:`refresh` of each hash, in order (the last one ends most recently used), with one
        ``touch`` and one ``free_blocks`` for all: an 8k-token prompt is 512 blocks."""
        get = self.cached_block_hash_to_block.get
        found = [get(h) for h in hashes]
        blocks = [b for b in found if b is not None]
        if blocks:
            self.touch(blocks)
            self.free_blocks(blocks)
        return [b is not None for b in found]

    def reserve(self, n: int) -> list[KVCacheBlock]:
        """Up to ``n`` blocks for a store, evicting LRU ones, each pinned until :meth:`publish` /
        ``free_blocks``; fewer when pinned blocks leave no room (the tier never waits for space)."""
        return self.get_new_blocks(min(n, self.num_free_blocks))

    def publish(self, blocks: list[KVCacheBlock], hashes: list[bytes]) -> None:
        """A store landed: register ``blocks[i]`` under ``hashes[i]`` (a hash the tier got meanwhile
        from another store leaves the block hash-less, reused first)."""
        cached = self.cached_block_hash_to_block
        stored = []
        for block, h in zip(blocks, hashes):
            if h not in cached:
                block.block_hash = h
                cached[h] = block
                stored.append(h)
        if stored and self.kv_events is not None:  # KV events: the tier's hashes (evictions: BlockPool's)
            # a store's blocks need not be one chain (several requests' blocks): no parent, no tokens,
            # as vLLM's offloading connector reports its tier
            self.kv_events.append(BlockStored(stored, None, [], self.event_block_size, None, self.medium))

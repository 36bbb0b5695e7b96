"""Physical KV blocks, the LRU free queue and the hash→block prefix cache, as in
vLLM's automatic prefix caching.

A block is in exactly one of three states: ACTIVE (``ref_cnt > 0``, owned by requests), CACHED-FREE
(``ref_cnt == 0`` with a hash: in the free queue and still matchable) or FREE (``ref_cnt == 0``, no
hash). Every ``ref_cnt == 0`` block sits in the free queue; eviction is lazy — ``get_new_blocks`` pops
the head and drops its hash. A freed block without a hash goes to the HEAD (it holds nothing reusable,
so it is reused first); a cached one to the TAIL (LRU: the longest-free cached block is evicted first),
as vLLM's block pool does. Callers free a request's blocks in reverse order so a chain's tail is
evicted before its head (no orphan chains: a
cached block whose parent was evicted could never match again, as lookups walk from block 0).

KV events (off unless :meth:`BlockPool.enable_kv_events`): every change of the hash→block map is
appended to ``kv_events`` as it happens — ``BlockStored`` when blocks are registered, ``BlockRemoved``
when hashes are evicted, unregistered or dropped by a reset (``AllBlocksCleared`` carries no
medium, so it would clear a subscriber's other tiers of this instance too) — so the set of hashes a
subscriber builds from them is the map's key set (``hwkv.core.kv_events``). The owner drains the list.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from hwkv.core.kv_events import BlockRemoved, BlockStored
from hwkv.core.request import Request


class KVCacheBlock:
    """One physical KV block; ``prev_free_block``/``next_free_block`` link it into the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """O(1) doubly linked LRU of free blocks between two sentinels: head side = evicted first."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.num_free_blocks = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("popleft from an empty free block queue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"popleft_n: n={n} exceeds the {self.num_free_blocks} free blocks")
        if n <= 0:
            return []
        ret = [None] * n
        curr = self.head.next_free_block
        for i in range(n):
            ret[i] = block = curr
            curr = block.next_free_block
            block.prev_free_block = block.next_free_block = None
        self.head.next_free_block = curr
        curr.prev_free_block = self.head
        self.num_free_blocks -= n
        return ret  # type: ignore[return-value]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free block queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Insert ``blocks`` at the head, in the given order (``blocks[0]`` is popped first)."""
        self._insert_n(self.head, blocks)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._insert_n(self.tail.prev_free_block, blocks)

    def _insert_n(self, prev: KVCacheBlock, blocks: Iterable[KVCacheBlock]) -> None:
        """Link ``blocks``, in order, between ``prev`` and its successor."""
        nxt = prev.next_free_block
        n = 0
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
            n += 1
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += n

    def __iter__(self) -> Iterator[KVCacheBlock]:
        curr = self.head.next_free_block
        while curr is not self.tail:
            yield curr
            curr = curr.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks


@dataclass
class PrefixCacheStats:
    """Lookups recorded by ``KVCacheManager.get_computed_blocks`` (in tokens) and pool evictions."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """``num_blocks`` blocks, a free queue and (when ``enable_caching``) ``cached_block_hash_to_block``.

    With ``use_null_block`` block 0 is reserved as a padding block: never handed out, freed or evicted.
    One hash maps to at most one block; a second block computed with an already-cached hash simply stays
    uncached (it is reused like any hash-less block).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, use_null_block: bool = False) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1 + use_null_block:
            raise ValueError(f"num_blocks must be an int >= {1 + use_null_block}, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.stats = PrefixCacheStats()
        self.null_block: KVCacheBlock | None = None
        if use_null_block:
            self.null_block = self.free_block_queue.popleft()
            self.null_block.is_null = True
        self.num_usable_blocks = num_blocks - use_null_block
        self.kv_events: list | None = None  # None: events off (no cost beyond one check)
        self.event_block_size = 0
        self.medium = ""

    def enable_kv_events(self, block_size: int, medium: str) -> None:
        """Start appending KV events to ``kv_events`` (``block_size``: tokens per block, for
        ``BlockStored.token_ids``; ``medium``: the tier's name in every event)."""
        self.kv_events, self.event_block_size, self.medium = [], block_size, medium

    def take_kv_events(self) -> list:
        """The events since the last call (empty when off)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` LRU blocks (evicting their hashes), each with ``ref_cnt = 1``."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"get_new_blocks: num_blocks={num_blocks} exceeds the {self.num_free_blocks} free blocks"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        cached = self.cached_block_hash_to_block
        evicted = [] if self.kv_events is not None else None
        for block in ret:
            if block.block_hash is not None:
                if evicted is not None:
                    evicted.append(block.block_hash)
                del cached[block.block_hash]
                block.block_hash = None
                self.stats.evictions += 1
            block.ref_cnt = 1
        if evicted:
            self.kv_events.append(BlockRemoved(evicted, self.medium))  # type: ignore[union-attr]
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt += 1; a block leaving ref_cnt 0 leaves the free queue (no longer evictable)."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """ref_cnt -= 1; blocks reaching 0 rejoin the free queue in the given order: cached ones at the
        tail (evicted in that order, after every older free block), hash-less ones at the head (reused
        before any cached block). Pass a request's blocks reversed so chain tails are evicted first."""
        blocks = [b for b in ordered_blocks if not b.is_null]
        for block in blocks:  # check all first: a double free must not leave the pool half-updated
            if block.ref_cnt <= 0:
                raise ValueError(f"free_blocks: {block} is already free (double free)")
        cached: list[KVCacheBlock] = []
        uncached: list[KVCacheBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (uncached if block.block_hash is None else cached).append(block)
        if uncached:
            self.free_block_queue.prepend_n(uncached)
        if cached:
            self.free_block_queue.append_n(cached)

    def cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_cached_blocks: int, num_full_blocks: int
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under ``request.block_hashes``."""
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if num_full_blocks > min(len(blocks), len(request.block_hashes)):
            raise ValueError(
                f"cache_full_blocks: num_full_blocks={num_full_blocks} exceeds the request's "
                f"{len(blocks)} blocks / {len(request.block_hashes)} block hashes"
            )
        cached = self.cached_block_hash_to_block
        hashes = request.block_hashes
        stored = [] if self.kv_events is not None else None
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:
                continue  # a prefix-cache hit: already registered
            h = hashes[i]
            if h not in cached:
                block.block_hash = h
                cached[h] = block
                if stored is not None:
                    stored.append(i)
        if not stored:
            return
        if len(stored) == 1:  # a decode filled its block: the common case, kept cheap
            i, bs = stored[0], self.event_block_size
            self.kv_events.append(BlockStored(  # type: ignore[union-attr]
                [hashes[i]], hashes[i - 1] if i else None, request.all_token_ids[i * bs:(i + 1) * bs], bs,
                request.lora_id, self.medium))
        else:
            self._stored_events(request, stored)

    def _stored_events(self, request: Request, indices: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive block indices of ``request`` just registered."""
        hashes, tokens, bs = request.block_hashes, request.all_token_ids, self.event_block_size
        start = prev = indices[0]
        for i in indices[1:] + [-1]:
            if i == prev + 1:
                prev = i
                continue
            self.kv_events.append(BlockStored(  # type: ignore[union-attr]
                hashes[start:prev + 1], hashes[start - 1] if start else None, tokens[start * bs:(prev + 1) * bs], bs,
                request.lora_id, self.medium))
            start = prev = i

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the prefix-cache registration of ``blocks`` (their KV will never be written)."""
        cached = self.cached_block_hash_to_block
        removed = []
        for block in blocks:
            if block.block_hash is not None and cached.get(block.block_hash) is block:
                del cached[block.block_hash]
                removed.append(block.block_hash)
            block.block_hash = None
        if removed and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(removed, self.medium))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False) while any block is held by a request."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        if self.kv_events is not None and self.cached_block_hash_to_block:
            self.kv_events.append(BlockRemoved(list(self.cached_block_hash_to_block), self.medium))
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

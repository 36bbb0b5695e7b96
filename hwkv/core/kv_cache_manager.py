"""Per-request block tables over one BlockPool, with prefix-cache lookup
(vLLM's KVCacheManager).

Scheduler protocol (vLLM v1 style):
1. ``blocks, n = get_computed_blocks(req)`` — a pure lookup (no ref counting).
2. ``allocate_slots(req, num_new_tokens, n, blocks)`` — touches the hit blocks, allocates the rest,
   registers newly full blocks; ``None`` means "preempt someone and retry", with nothing changed.
3. ``free(req)`` when the request finishes or is preempted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from functools import partial
from itertools import islice, takewhile
from operator import attrgetter, is_not

from hwkv.core.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_events import MEDIUM_GPU
from hwkv.core.request import Request

_is_block = partial(is_not, None)
_block_hash = attrgetter("block_hash")


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # request_id -> blocks already registered
        self._hasher = make_block_hasher(block_size)  # for requests created without a block_hasher

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def stats(self) -> PrefixCacheStats:
        return self.block_pool.stats

    def _sync_hashes(self, request: Request) -> None:
        hasher = request.block_hasher
        if hasher is None:
            request.block_hashes.extend(self._hasher(request))
        elif getattr(hasher, "block_size", self.block_size) != self.block_size:
            raise ValueError(
                f"request {request.request_id!r}: block_hasher.block_size={hasher.block_size} "
                f"!= KVCacheManager.block_size={self.block_size}"
            )

    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``, as (blocks, num_computed_tokens).

        Matches from block 0 and stops at the first miss (a block's hash chains its whole prefix, so
        nothing after a miss can match). The last token is never
        counted (the model must compute at least one token to produce logits), so at most
        ``(num_tokens - 1) // block_size`` blocks match. Does not touch: ``allocate_slots`` does.
        With ``record_stats=False`` the caller records the lookup itself (``record_prefix_query``),
        e.g. only once the request is admitted, so a request retried every step counts once.
        """
        if not self.enable_caching:
            return [], 0
        self._sync_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        if len(hashes) > max_blocks:
            hashes = islice(hashes, max_blocks)
        blocks = list(takewhile(_is_block, map(self.block_pool.cached_block_hash_to_block.get, hashes)))
        num_computed = len(blocks) * self.block_size
        if record_stats:
            self.record_prefix_query(request, num_computed)
        return blocks, num_computed

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        stats = self.block_pool.stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_tokens: int = 0,
        *,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Grow ``request``'s block table to hold its computed tokens plus the new ones.

        Slots cover ``request.num_computed_tokens + num_new_computed_tokens`` (local prefix hit,
        ``new_computed_blocks`` from ``get_computed_blocks``) ``+ num_new_tokens`` (this step's tokens;
        the first ``num_external_tokens`` of them are loaded by a KV connector instead of computed)
        ``+ num_lookahead_tokens`` (speculative slots, never cached). Returns the newly allocated
        blocks, or ``None`` — with no side effect — when the pool cannot serve it. Cached hit blocks
        with ref_cnt 0 sit in the free queue but are not free capacity: touching them removes them.

        Newly full blocks (up to ``min(computed + num_new_tokens, request.num_tokens)``) are registered
        in the prefix cache, except when ``delay_cache_blocks`` or ``num_external_tokens`` is set: the
        external KV may still be in flight, so registration waits for the request's next
        ``allocate_slots`` (or an explicit ``cache_blocks``).
        """
        if not (  # inline fast path: this runs for every running request every step
            type(num_new_tokens) is int and num_new_tokens >= 0
            and type(num_new_computed_tokens) is int and num_new_computed_tokens >= 0
            and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0
            and type(num_external_tokens) is int and num_external_tokens >= 0
        ):
            _check_count("num_new_tokens", num_new_tokens)
            _check_count("num_new_computed_tokens", num_new_computed_tokens)
            _check_count("num_lookahead_tokens", num_lookahead_tokens)
            _check_count("num_external_tokens", num_external_tokens)
        if num_external_tokens > num_new_tokens:
            raise ValueError(
                f"num_external_tokens={num_external_tokens} must be <= num_new_tokens={num_new_tokens} "
                "(external tokens are part of the new tokens)"
            )
        bs = self.block_size
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        num_held = len(req_blocks) if req_blocks else 0
        num_hit = 0
        if new_computed_blocks or num_new_computed_tokens:
            num_hit = self._check_computed_blocks(request, new_computed_blocks or [], num_new_computed_tokens, num_held)

        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        num_new_blocks = -(-num_slots // bs) - num_held - num_hit
        if num_new_blocks > 0:
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0) if num_hit else 0
            if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
                return None
        else:
            num_new_blocks = 0

        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
        if num_hit:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[rid] = num_hit
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        if new_blocks:
            req_blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks and not num_external_tokens:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def num_blocks_short(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> int:
        """How many more free blocks ``allocate_slots`` with these arguments would need; 0: it fits now.

        Same accounting as ``allocate_slots`` (evictable hit blocks are not capacity), no side effect.
        """
        hits = new_computed_blocks or ()
        num_slots = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        need = -(-num_slots // self.block_size) - len(self.req_to_blocks.get(request.request_id, ())) - len(hits)
        if need <= 0:
            return 0
        return max(0, need + sum(1 for b in hits if b.ref_cnt == 0) - self.block_pool.num_free_blocks)

    def num_reclaimable_blocks(self, request_ids: Iterable[str], keep: Iterable[KVCacheBlock] = ()) -> int:
        """Blocks that freeing every request in ``request_ids`` would add to the free capacity: those no
        other request holds, except ``keep`` (hit blocks about to be touched again are no capacity)."""
        counts = Counter(b for rid in request_ids for b in self.req_to_blocks.get(rid, ()))
        kept = set(map(id, keep))
        return sum(1 for b, n in counts.items() if n == b.ref_cnt and not b.is_null and id(b) not in kept)

    def _check_computed_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int, num_held: int
    ) -> int:
        if not self.enable_caching:
            raise ValueError("new_computed_blocks / num_new_computed_tokens given but prefix caching is disabled")
        if num_tokens != len(blocks) * self.block_size:
            raise ValueError(
                f"num_new_computed_tokens={num_tokens} must equal len(new_computed_blocks)*block_size="
                f"{len(blocks) * self.block_size}"
            )
        if num_held or request.num_computed_tokens:
            raise ValueError(
                f"new_computed_blocks given for request {request.request_id!r} that already holds "
                f"{num_held} blocks / {request.num_computed_tokens} computed tokens"
            )
        if list(map(_block_hash, blocks)) != request.block_hashes[: len(blocks)]:
            raise ValueError(
                f"new_computed_blocks for request {request.request_id!r} are stale (evicted or reused since "
                "get_computed_blocks); look them up again"
            )
        return len(blocks)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full within its first ``num_computed_tokens`` tokens."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_computed_tokens // self.block_size
        if num_full <= num_cached:
            return
        if len(request.block_hashes) < num_full:
            self._sync_hashes(request)
        blocks = self.req_to_blocks.get(rid, ())
        num_full = min(num_full, len(request.block_hashes), len(blocks))
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
            self.num_cached_block[rid] = num_full

    def uncache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """A step that was to compute the request's tokens from ``num_computed_tokens`` on failed:
        unregister the blocks registered for that step (full only with its tokens), whose KV was
        never written, so no request can hit them. Call before :meth:`free`."""
        rid = request.request_id
        keep = num_computed_tokens // self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        if num_cached > keep:
            self.block_pool.uncache_blocks(self.req_to_blocks[rid][keep:num_cached])
            self.num_cached_block[rid] = keep

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so chain tails are evicted before heads (no orphan
        chains)."""
        self.num_cached_block.pop(request.request_id, None)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def enable_kv_events(self, medium: str = MEDIUM_GPU) -> None:
        """Record the prefix cache's KV events (``hwkv.core.kv_events``); :meth:`take_kv_events` drains them."""
        if self.enable_caching:
            self.block_pool.enable_kv_events(self.block_size, medium)

    def take_kv_events(self) -> list:
        return self.block_pool.take_kv_events()

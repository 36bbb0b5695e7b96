"""KV-cache groups for hybrid-attention models (vLLM's hybrid allocator, with a pool per group).

Layers are grouped by attention kind: one group of full-attention layers and one group per sliding
window size (:func:`layer_groups`). Each group has its own :class:`BlockPool` (its layers' KV
tensors hold that many blocks), its own block table per request and its own prefix-cache hashes (a
group's pool maps the chained token-block hashes to *its* blocks, so equal hashes never alias across
groups). A block id means "this block of every layer of the group".

* A full group behaves exactly as :class:`KVCacheManager`.
* A window group (:class:`WindowKVCacheManager`) keeps only the blocks that some future query can
  see: when a request's computed length reaches ``c``, the next query at position ``c`` sees keys in
  ``(c - window, c]``, so every block wholly before ``c - window + 1`` is freed (still cached, so
  evictable, not lost) and its table entry becomes the pool's null block. A request holds at most
  ``ceil((window - 1 + new tokens) / block_size) + 1`` live blocks of the group: memory follows
  the window, not the context.
* A prefix hit of ``n`` blocks needs, in the full group, blocks ``0..n-1`` cached (the chain), and in
  a window group only the blocks the next query sees, ``[(n * bs - window + 1) // bs, n)``. The
  usable hit is the longest ``n`` every group serves (:meth:`GroupedKVCacheManager.get_computed_blocks`).
* Admission: a step fits only if it fits in every group (window frees counted); nothing is allocated
  in any group otherwise.
* KV events report the first group's prefix cache (the full group's when there is one).

:class:`GroupedKVCacheManager` has :class:`KVCacheManager`'s scheduler protocol (the Scheduler runs
on it unchanged); the prefix-hit "blocks" it hands out are one list per group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hwkv.core.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.kv_events import MEDIUM_GPU
from hwkv.core.request import Request


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers sharing one block table: ``window`` ``None`` is full attention."""

    layers: tuple[int, ...]
    window: int | None
    num_blocks: int


def layer_groups(windows: Sequence[int | None]) -> list[tuple[int | None, tuple[int, ...]]]:
    """``(window, layers)`` per attention kind of a model whose layer ``i`` has window ``windows[i]``
    (``None``: full attention); the full group first, then windows in increasing size."""
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    for w in kinds:
        if w is not None and (not isinstance(w, int) or w < 1):
            raise ValueError(f"a sliding window must be an int >= 1, got {w!r}")
    return [(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in kinds]


class WindowKVCacheManager(KVCacheManager):
    """One sliding-window group: blocks that fell out of every future query's window are freed."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool = True,
                 max_step_tokens: int | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        # the most tokens one step schedules for a request: a question about more (the scheduler's
        # whole-prompt reservation) is answered for one step of them, since the blocks of earlier
        # steps leave the window before later ones need theirs
        self.max_step_tokens = max_step_tokens
        self.block_pool = BlockPool(num_blocks, enable_caching, use_null_block=True)
        self.null = self.block_pool.null_block
        assert self.null is not None
        self.null.ref_cnt = 1  # never free, never an evictable hit (touch and free_blocks skip it)

    def first_needed(self, num_computed: int) -> int:
        """Index of the oldest block a query at position ``num_computed`` still sees."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def longest_hit(self, request: Request, max_blocks: int) -> int:
        """Largest ``n <= max_blocks`` whose window ``[first_needed(n * bs), n)`` is cached (0: none)."""
        if not self.enable_caching:
            return 0
        self._sync_hashes(request)
        get = self.block_pool.cached_block_hash_to_block.get
        hashes = request.block_hashes
        run = 0  # cached blocks ending at block n - 1
        best = 0
        for n in range(1, min(max_blocks, len(hashes)) + 1):
            run = run + 1 if get(hashes[n - 1]) is not None else 0
            if run >= n - self.first_needed(n * self.block_size):
                best = n
        return best

    def hit_blocks(self, request: Request, n: int) -> list[KVCacheBlock]:
        """The table of an ``n``-block hit: null before the window, cached blocks inside it."""
        lo = self.first_needed(n * self.block_size)
        get = self.block_pool.cached_block_hash_to_block.get
        return [self.null] * lo + [get(h) for h in request.block_hashes[lo:n]]  # type: ignore[misc]

    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching:
            return [], 0
        self._sync_hashes(request)
        n = self.longest_hit(request, (request.num_tokens - 1) // self.block_size)
        if record_stats:
            self.record_prefix_query(request, n * self.block_size)
        return self.hit_blocks(request, n), n * self.block_size

    def _outside(self, request: Request, num_computed: int) -> list[KVCacheBlock]:
        """Live blocks of ``request`` wholly before the window of a query at ``num_computed``."""
        blocks = self.req_to_blocks.get(request.request_id, ())
        lo = min(self.first_needed(num_computed), len(blocks))
        return [b for b in blocks[:lo] if not b.is_null]

    def free_outside_window(self, request: Request, num_computed: int) -> int:
        """Free the request's blocks no query from ``num_computed`` on can see; returns how many."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        lo = min(self.first_needed(num_computed), len(blocks))
        dead = [b for b in blocks[:lo] if not b.is_null]
        if dead:
            blocks[:lo] = [self.null] * lo
            self.block_pool.free_blocks(dead)  # oldest first: evicted before the window's blocks
        return len(dead)

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None, num_lookahead_tokens: int = 0,
                       num_external_tokens: int = 0, *, delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """:meth:`KVCacheManager.allocate_slots`, first freeing the blocks that fell out of the window
        (those are freed even when the step does not fit: no query will read them again). External
        tokens (a KV connector loads them): the table entries wholly before the window of the first
        token after them are the null block, never allocated - a P/D consumer of a prompt longer than
        the window group's pool needs only the window."""
        self.free_outside_window(request, request.num_computed_tokens + num_new_computed_tokens)
        if num_external_tokens and 0 <= num_external_tokens <= num_new_tokens:
            plan = self._external_plan(request, num_new_tokens + num_lookahead_tokens, num_new_computed_tokens,
                                       new_computed_blocks, num_external_tokens)
            if plan is None:
                return None
            nulls, new, hits = plan
            table = self.req_to_blocks.setdefault(request.request_id, [])
            if hits:
                self.block_pool.touch(hits)
                table.extend(hits)
                self.num_cached_block[request.request_id] = len(hits)
            got = self.block_pool.get_new_blocks(new) if new else []
            table.extend([self.null] * nulls + got)
            return [self.null] * nulls + got  # the table grew by this many entries
        return super().allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                      num_lookahead_tokens, num_external_tokens,
                                      delay_cache_blocks=delay_cache_blocks)

    def _external_plan(self, request: Request, num_slots_new: int, num_new_computed_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None,
                       num_external_tokens: int) -> tuple[int, int, list[KVCacheBlock]] | None:
        """``(null entries, new blocks, hit blocks)`` of an allocation with external tokens, ``None`` when
        the pool cannot serve it (no side effect)."""
        hits = list(new_computed_blocks or ())
        held = len(self.req_to_blocks.get(request.request_id, ()))
        if hits or num_new_computed_tokens:
            self._check_computed_blocks(request, hits, num_new_computed_tokens, held)
        c = request.num_computed_tokens + num_new_computed_tokens
        have = held + len(hits)
        nulls = max(0, self.first_needed(c + num_external_tokens) - have)
        new = max(0, -(-(c + num_slots_new) // self.block_size) - have - nulls)
        if new > self.block_pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0):
            return None
        return nulls, new, hits

    def num_external_blocks_short(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int,
                                  new_computed_blocks: list[KVCacheBlock] | None, num_external_tokens: int) -> int:
        """:meth:`num_blocks_short` of an allocation with external tokens (their blocks before the window
        are null entries: :meth:`allocate_slots`)."""
        hits = list(new_computed_blocks or ())
        have = len(self.req_to_blocks.get(request.request_id, ())) + len(hits)
        c = request.num_computed_tokens + num_new_computed_tokens
        nulls = max(0, self.first_needed(c + num_external_tokens) - have)
        new = max(0, -(-(c + num_new_tokens) // self.block_size) - have - nulls)
        return max(0, new + sum(1 for b in hits if b.ref_cnt == 0) - self.block_pool.num_free_blocks)

    def _check_computed_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int,
                               num_held: int) -> int:
        live = [b for b in blocks if not b.is_null]
        n = len(blocks)
        if num_tokens != n * self.block_size or live != self.hit_blocks(request, n)[n - len(live):]:
            raise ValueError(f"new_computed_blocks for request {request.request_id!r} are stale or not a window "
                             "hit of get_computed_blocks; look them up again")
        if num_held or request.num_computed_tokens:
            raise ValueError(f"new_computed_blocks given for request {request.request_id!r} that already holds "
                             f"{num_held} blocks / {request.num_computed_tokens} computed tokens")
        return n

    def num_blocks_short(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                         new_computed_blocks: list[KVCacheBlock] | None = None) -> int:
        hits = new_computed_blocks or ()
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        if self.max_step_tokens is not None:
            num_new_tokens = min(num_new_tokens, self.max_step_tokens)
        need = -(-(num_computed + num_new_tokens) // self.block_size)
        need -= len(self.req_to_blocks.get(request.request_id, ())) + len(hits)
        if need <= 0:
            return 0
        # blocks the window frees first (only those this request alone holds become free)
        freed = sum(1 for b in self._outside(request, num_computed) if b.ref_cnt == 1)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        return max(0, need + evictable_hits - self.block_pool.num_free_blocks - freed)

    def num_live_blocks(self, request_id: str) -> int:
        return sum(1 for b in self.req_to_blocks.get(request_id, ()) if not b.is_null)


class GroupedKVCacheManager:
    """:class:`KVCacheManager`'s scheduler protocol over several KV-cache groups (module docstring).
    Blocks returned and accepted are one list per group, in ``groups`` order."""

    def __init__(self, groups: Sequence[KVCacheGroup], block_size: int, enable_caching: bool = True,
                 max_step_tokens: int | None = None) -> None:
        """``max_step_tokens``: the most tokens a step schedules for one request (the token budget plus
        lookahead slots): window groups answer ``num_blocks_short`` for at most that many new tokens."""
        if not groups:
            raise ValueError("at least one KV-cache group is needed")
        self.groups = list(groups)
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.managers: list[KVCacheManager] = [
            KVCacheManager(g.num_blocks, block_size, enable_caching) if g.window is None
            else WindowKVCacheManager(g.num_blocks, block_size, g.window, enable_caching, max_step_tokens)
            for g in self.groups]
        self.last_new_blocks: list[list[KVCacheBlock]] = []

    @property
    def num_free_blocks(self) -> int:
        """The first group's free blocks (the full group's where there is one: the pool the longest
        request needs; ``Engine.stats()`` reports it beside ``num_kv_blocks``)."""
        return self.managers[0].block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return max(m.usage for m in self.managers)

    @property
    def stats(self) -> PrefixCacheStats:
        return self.managers[0].stats

    def get_computed_blocks(self, request: Request,
                            record_stats: bool = True) -> tuple[list[list[KVCacheBlock]], int]:
        """The longest prefix every group can serve: the full groups' chained hit, cut back until each
        window group has that prefix's window cached (a fixpoint: a shorter prefix needs other blocks)."""
        if not self.enable_caching:
            return [[] for _ in self.managers], 0
        n = (request.num_tokens - 1) // self.block_size
        for m in self.managers:
            if not isinstance(m, WindowKVCacheManager):
                n = min(n, m.get_computed_blocks(request, record_stats=False)[1] // self.block_size)
        windows = [m for m in self.managers if isinstance(m, WindowKVCacheManager)]
        while True:
            cut = min([m.longest_hit(request, n) for m in windows] or [n])
            if cut == n:
                break
            n = cut
        blocks = [m.hit_blocks(request, n) if isinstance(m, WindowKVCacheManager)
                  else m.get_computed_blocks(request, record_stats=False)[0][:n] for m in self.managers]
        if record_stats:
            self.record_prefix_query(request, n * self.block_size)
        return blocks, n * self.block_size

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        self.managers[0].record_prefix_query(request, num_hit_tokens)

    def _split(self, blocks: list[list[KVCacheBlock]] | None) -> list[list[KVCacheBlock] | None]:
        if not blocks:
            return [None] * len(self.managers)
        if len(blocks) != len(self.managers):
            raise ValueError(f"new_computed_blocks must be one list per KV-cache group ({len(self.managers)}), "
                             f"got {len(blocks)}")
        return list(blocks)

    def num_blocks_short(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                         new_computed_blocks: list[list[KVCacheBlock]] | None = None) -> int:
        """The largest shortfall over the groups (each group's blocks come from its own pool)."""
        return max(m.num_blocks_short(request, num_new_tokens, num_new_computed_tokens, hits)
                   for m, hits in zip(self.managers, self._split(new_computed_blocks)))

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[list[KVCacheBlock]] | None = None, num_lookahead_tokens: int = 0,
                       num_external_tokens: int = 0, *,
                       delay_cache_blocks: bool = False) -> list[KVCacheBlock] | None:
        """Every group's :meth:`KVCacheManager.allocate_slots`, or ``None`` with nothing allocated in any
        group (window groups may have freed blocks out of their window). Returns the first group's new
        blocks (every group's table grows by as many entries, which the scheduler's slot count uses);
        :attr:`last_new_blocks` has each group's."""
        hits = self._split(new_computed_blocks)
        total = num_new_tokens + num_lookahead_tokens

        def short(m: KVCacheManager, h: list[KVCacheBlock] | None) -> int:
            if num_external_tokens and isinstance(m, WindowKVCacheManager):  # null entries before the window
                return m.num_external_blocks_short(request, total, num_new_computed_tokens, h, num_external_tokens)
            return m.num_blocks_short(request, total, num_new_computed_tokens, h)

        if any(short(m, h) for m, h in zip(self.managers, hits)):
            return None
        out = []
        for m, h in zip(self.managers, hits):
            got = m.allocate_slots(request, num_new_tokens, num_new_computed_tokens, h, num_lookahead_tokens,
                                   num_external_tokens, delay_cache_blocks=delay_cache_blocks)
            if got is None:  # the checks above are exact: a failure here is a bug, not a full pool
                raise RuntimeError(f"KV-cache group {self.managers.index(m)} refused an allocation it was checked for")
            out.append(got)
        self.last_new_blocks = out
        return out[0]

    def num_reclaimable_blocks(self, request_ids: Iterable[str],
                               keep: Iterable[Iterable[KVCacheBlock]] = ()) -> int:
        """The smallest over the groups (what preempting them frees in the tightest pool)."""
        ids = list(request_ids)
        keeps = list(keep) or [()] * len(self.managers)
        return min(m.num_reclaimable_blocks(ids, k) for m, k in zip(self.managers, keeps))

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.cache_blocks(request, num_computed_tokens)

    def uncache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for m in self.managers:
            m.uncache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        for m in self.managers:
            m.free(request)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The first group's table (the full group's when there is one); :meth:`get_group_block_ids` has all."""
        return self.managers[0].get_block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> list[list[int]]:
        """One block table per group; a window group's entries before the window are the null block (0)."""
        return [m.get_block_ids(request_id) for m in self.managers]

    def step_block_ids(self, new_reqs: Iterable[Any], cached: Any) -> dict[str, list[list[int]]]:
        """A step's block ids of groups 1.. for the runner (``SchedulerOutput.group_block_ids``): each
        new request's whole tables, each running request's appended ids (its tables' tails: every group's
        table grows by as many entries as group 0's)."""
        rest = self.managers[1:]
        out = {r.req_id: [m.get_block_ids(r.req_id) for m in rest] for r in new_reqs}
        for rid, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids:
                out[rid] = [[b.block_id for b in m.req_to_blocks[rid][-len(ids):]] for m in rest]
        return out

    def get_blocks(self, request_id: str) -> list[list[KVCacheBlock]]:
        return [m.get_blocks(request_id) for m in self.managers]

    def num_live_blocks(self, request_id: str) -> list[int]:
        """Blocks the request holds in each group (null entries not counted)."""
        return [sum(1 for b in m.get_blocks(request_id) if not b.is_null) for m in self.managers]

    def enable_kv_events(self, medium: str = MEDIUM_GPU) -> None:
        """KV events of the first group (the full-attention group's where there is one: its hashes are
        the prefix chain, so a subscriber's longest match bounds the usable hit; a window group's blocks
        are not reported - the hit a window group serves may be shorter)."""
        self.managers[0].enable_kv_events(medium)

    def take_kv_events(self) -> list:
        return self.managers[0].take_kv_events()

    @property
    def event_pool(self) -> BlockPool:
        """The block pool whose prefix cache KV events report (snapshots read it)."""
        return self.managers[0].block_pool

    def reset_prefix_cache(self) -> bool:
        if any(m.block_pool.num_free_blocks != m.block_pool.num_usable_blocks for m in self.managers):
            return False
        return all([m.reset_prefix_cache() for m in self.managers])

"""Hypothesis state machine over the prefix cache: admit (lookup + touch + allocate), chunked prefill and
decode steps (with lookahead slots), finish, preempt, same-step races, probes and resets.

A shadow model records what each physical block really holds — (cache_salt, the token prefix its KV
encodes) — whenever the "model" writes a block. After every step: blocks are conserved, a block is in the
free queue iff ref_cnt == 0, ref counts equal table membership, the hash map and block hashes agree, and
every cached block's content hashes to its key; every prefix hit is checked against the shadow, so a
block whose chain predecessor was evicted can never be returned as a match with the wrong content.

KV events are on: a subscriber's index, rebuilt from nothing but the events, equals the cache's key
set after every step, and every ``BlockStored`` chain hashes from its parent and tokens.
"""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hwkv.core.hashing import ROOT_HASH, extra_keys, hash_block_tokens, hash_token_blocks, make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.kv_events import MEDIUM_GPU, BlockStored, apply_events
from hwkv.core.request import Request

BS = 4
NUM_BLOCKS = 16
MAX_TOKENS = 40
BASES = [[(7 * i + k) % 5 for i in range(24)] for k in range(2)]  # a few "system prompts"
tail = st.lists(st.integers(0, 2), max_size=6)
# Prompts share long prefixes: a cut of one of the bases plus a short random tail.
prompts = st.builds(lambda b, cut, t: (BASES[b][:cut] + t) or [0], st.integers(0, 1), st.integers(0, 24), tail)
salts = st.sampled_from([None, None, None, "s"])
index = st.integers(0, 1000)


def snapshot(m):
    bp = m.block_pool
    return (
        [b.block_id for b in bp.free_block_queue],
        [(b.ref_cnt, b.block_hash) for b in bp.blocks],
        dict(bp.cached_block_hash_to_block),
        {k: [b.block_id for b in v] for k, v in m.req_to_blocks.items()},
        dict(m.num_cached_block),
    )


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BS)
        self.m.enable_kv_events()
        self.index: set[bytes] = set()  # a subscriber's view, from the events alone
        self.hasher = make_block_hasher(BS)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.shadow: dict[int, tuple] = {}  # block_id -> (salt, token prefix encoded by its KV)
        self.n = 0

    def new_request(self, tokens, salt):
        self.n += 1
        return Request(f"r{self.n}", tokens, block_hasher=self.hasher, cache_salt=salt)

    def check_hits(self, r, blocks, n):
        assert n == len(blocks) * BS and n <= r.num_tokens - 1
        for j, b in enumerate(blocks):
            assert self.shadow.get(b.block_id) == (r.cache_salt, tuple(r.all_token_ids[: (j + 1) * BS])), (
                f"prefix hit {j} of {r.request_id} returned block {b.block_id} holding other content"
            )

    def write(self, r, start, end):
        """The model writes KV for positions [start, end) of r into its blocks."""
        blocks = self.m.get_blocks(r.request_id)
        for j in range(start // BS, (end - 1) // BS + 1):
            self.shadow[blocks[j].block_id] = (r.cache_salt, tuple(r.all_token_ids[: min((j + 1) * BS, end)]))

    def try_allocate(self, r, num_new, num_hit=0, hits=None, lookahead=0):
        before = snapshot(self.m)
        new = self.m.allocate_slots(r, num_new, num_hit, hits, num_lookahead_tokens=lookahead)
        if new is None:
            assert snapshot(self.m) == before, "allocate_slots returned None but changed state"
            return False
        start = r.num_computed_tokens + num_hit
        if num_new:
            self.write(r, start, start + num_new)
        r.num_computed_tokens = start + num_new
        return True

    def admit_one(self, r, chunk, lookahead):
        blocks, n = self.m.get_computed_blocks(r)
        self.check_hits(r, blocks, n)
        if not self.try_allocate(r, min(chunk, r.num_tokens - n), n, blocks, lookahead):
            return False
        self.running.append(r)
        return True

    @rule(tokens=prompts, salt=salts)
    def add(self, tokens, salt):
        self.waiting.append(self.new_request(tokens, salt))

    @rule(tokens=prompts, salt=salts)
    def probe(self, tokens, salt):
        r = self.new_request(tokens, salt)
        self.check_hits(r, *self.m.get_computed_blocks(r))

    @precondition(lambda self: self.running or self.waiting)
    @rule(i=index, extra=tail)
    def probe_existing(self, i, extra):
        reqs = self.running + self.waiting
        src = reqs[i % len(reqs)]
        r = self.new_request(src.all_token_ids + extra, src.cache_salt)
        self.check_hits(r, *self.m.get_computed_blocks(r))

    @precondition(lambda self: self.waiting)
    @rule(i=index, chunk=st.integers(1, 12), lookahead=st.integers(0, 3))
    def admit(self, i, chunk, lookahead):
        r = self.waiting[i % len(self.waiting)]
        if self.admit_one(r, chunk, lookahead):
            self.waiting.remove(r)

    @rule(k=st.integers(1, 4))
    def filler(self, k):
        """A request with unseen tokens taking k blocks: evicts exactly the k LRU free blocks."""
        r = self.new_request([100 + self.n] * (k * BS), None)
        self.admit_one(r, k * BS, 0)

    @rule(tokens=prompts, salt=salts)
    def admit_pair(self, tokens, salt):
        """Two identical requests looked up before either allocates (same scheduler step): the second
        computes duplicates of blocks the first registers; duplicates must stay uncached."""
        a, b = self.new_request(tokens, salt), self.new_request(tokens, salt)
        hits_b = self.m.get_computed_blocks(b)
        self.check_hits(b, *hits_b)
        if not self.admit_one(a, 64, 0):
            return
        if not self.try_allocate(b, b.num_tokens - hits_b[1], hits_b[1], hits_b[0]):
            self.waiting.append(b)
            b.num_computed_tokens = 0
            return
        self.running.append(b)

    @precondition(lambda self: self.running)
    @rule(i=index, chunk=st.integers(1, 12), lookahead=st.integers(0, 3), tok=st.integers(0, 2))
    def step(self, i, chunk, lookahead, tok):
        r = self.running[i % len(self.running)]
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= MAX_TOKENS:
                return self.finish(i)
            r.append_output_token_ids(tok)  # sampled by the previous step
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        if not self.try_allocate(r, n, lookahead=lookahead):
            self.preempt(i)

    @precondition(lambda self: self.running)
    @rule(i=index)
    def finish(self, i):
        r = self.running.pop(i % len(self.running))
        self.m.free(r)
        self.finished.append(r)

    @precondition(lambda self: self.finished)
    @rule(i=index, extra=tail)
    def next_turn(self, i, extra):
        """A finished conversation comes back longer: hits its blocks sitting free in the queue."""
        src = self.finished[i % len(self.finished)]
        r = self.new_request(src.all_token_ids + extra + [1], src.cache_salt)
        if not self.admit_one(r, 64, 0):
            self.waiting.append(r)

    @precondition(lambda self: self.running)
    @rule(i=index)
    def finish_forward_order(self, i):
        """Free head-first (the order reverse freeing avoids) to make orphan chains — H0 evicted while H1
        stays cached. Eviction quality suffers, but matching must still never return wrong content."""
        r = self.running.pop(i % len(self.running))
        self.m.num_cached_block.pop(r.request_id, None)
        self.m.block_pool.free_blocks(self.m.req_to_blocks.pop(r.request_id, []))

    @precondition(lambda self: self.running)
    @rule(i=index)
    def preempt(self, i):
        r = self.running.pop(i % len(self.running))
        self.m.free(r)
        r.num_computed_tokens = 0
        self.waiting.append(r)

    @rule()
    def reset(self):
        idle = self.m.num_free_blocks == NUM_BLOCKS
        assert self.m.reset_prefix_cache() == idle
        if idle:
            assert not self.m.block_pool.cached_block_hash_to_block

    @invariant()
    def events_match_the_cache(self):
        events = self.m.take_kv_events()
        for ev in events:
            if isinstance(ev, BlockStored):
                assert ev.medium == MEDIUM_GPU and ev.block_size == BS
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                parent = ev.parent_block_hash or ROOT_HASH
                for j, h in enumerate(ev.block_hashes):  # the chain follows from parent + tokens (salt: either)
                    toks = ev.token_ids[j * BS : (j + 1) * BS]
                    first = parent is ROOT_HASH
                    assert h in {hash_block_tokens(parent, toks, extra_keys(s)[0 if first else 1]) for s in (None, "s")}
                    parent = h
        apply_events(self.index, events)
        assert self.index == set(self.m.block_pool.cached_block_hash_to_block)

    @invariant()
    def consistent(self):
        bp = self.m.block_pool
        queue = list(bp.free_block_queue)
        assert len(queue) == bp.num_free_blocks == len({b.block_id for b in queue})
        in_queue = {b.block_id for b in queue}
        held = Counter(b.block_id for blocks in self.m.req_to_blocks.values() for b in blocks)
        assert len(in_queue) + sum(b.ref_cnt > 0 for b in bp.blocks) == NUM_BLOCKS
        for b in bp.blocks:
            assert b.ref_cnt == held[b.block_id]
            assert (b.block_id in in_queue) == (b.ref_cnt == 0)
            if b.block_hash is not None:
                assert bp.cached_block_hash_to_block[b.block_hash] is b
                salt, prefix = self.shadow[b.block_id]
                assert prefix and len(prefix) % BS == 0
                assert hash_token_blocks(list(prefix), BS, cache_salt=salt)[-1] == b.block_hash
        for h, b in bp.cached_block_hash_to_block.items():
            assert b.block_hash == h
        assert set(self.m.req_to_blocks) <= {r.request_id for r in self.running}
        for r in self.running:
            assert len(self.m.get_blocks(r.request_id)) * BS >= r.num_computed_tokens

    def teardown(self):
        for r in self.running:
            self.m.free(r)
        assert self.m.num_free_blocks == NUM_BLOCKS and self.m.usage == 0.0
        assert all(b.ref_cnt == 0 for b in self.m.block_pool.blocks)
        assert not self.m.req_to_blocks and not self.m.num_cached_block


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixCache = PrefixCacheMachine.TestCase

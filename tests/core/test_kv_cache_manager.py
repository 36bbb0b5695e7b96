"""KVCacheManager: prefix hits, the free-queue timeline of a shared system prompt, reverse-order
freeing (chain tails evicted first), matching that stops at the first miss."""

import dataclasses

import pytest

from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.request import Request

SYS = list(range(1000, 1032))  # 32-token system prompt = 2 blocks of 16


def req(rid, tokens, bs=16, **kw):
    return Request(rid, list(tokens), block_hasher=make_block_hasher(bs), **kw)


def queue_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue]


def refs(m, *ids):
    return [m.block_pool.blocks[i].ref_cnt for i in ids]


def schedule(m, r, lookahead=0):
    """Admit ``r`` like the scheduler: prefix lookup, then allocate the rest of the prompt."""
    blocks, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, blocks, num_lookahead_tokens=lookahead)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    return new


def snapshot(m):
    bp = m.block_pool
    return (
        queue_ids(m),
        [(b.ref_cnt, b.block_hash) for b in bp.blocks],
        dict(bp.cached_block_hash_to_block),
        {k: [b.block_id for b in v] for k, v in m.req_to_blocks.items()},
        dict(m.num_cached_block),
        dataclasses.astuple(bp.stats),
    )


def test_prefix_hit_flow():
    m = KVCacheManager(10, 16)
    a = req("A", SYS + list(range(16)))
    schedule(m, a)
    assert m.get_block_ids("A") == [0, 1, 2]
    b = req("B", SYS + list(range(50, 66)))  # same system prompt, different question
    blocks, n = m.get_computed_blocks(b)
    assert [x.block_id for x in blocks] == [0, 1] and n == 32  # H0, H1 hit; H2 misses
    assert refs(m, 0, 1) == [1, 1]  # lookup does not touch
    new = m.allocate_slots(b, b.num_tokens - n, n, blocks)
    assert [x.block_id for x in new] == [3]
    assert m.get_block_ids("B") == [0, 1, 3] and refs(m, 0, 1, 3) == [2, 2, 1]
    assert b.num_tokens - n == 16  # only the question is computed
    assert m.stats.queries == 96 and m.stats.hits == 32 and m.stats.hit_rate == pytest.approx(1 / 3)


def test_free_queue_timeline_t0_to_t7():
    """Two requests sharing a system prompt over 10 blocks. Blocks are freed in reverse order (chain
    tails evicted first), and hash-less (partial) blocks go to the queue head (vLLM's order): the queue after t=5 is
    [B3, B2, B4..B9, B1, B0], so at t=7 the chain tail H1 is evicted before H0."""
    m = KVCacheManager(10, 16)
    bp = m.block_pool
    # t=0: all blocks free, oldest first
    assert queue_ids(m) == list(range(10)) and not bp.cached_block_hash_to_block
    # t=1: A (32-token system prompt + 12-token question) gets 3 blocks
    a = req("A", SYS + list(range(12)))
    assert m.allocate_slots(a, a.num_tokens, delay_cache_blocks=True) is not None
    assert m.get_block_ids("A") == [0, 1, 2] and refs(m, 0, 1, 2) == [1, 1, 1]
    assert queue_ids(m) == list(range(3, 10)) and not bp.cached_block_hash_to_block
    # t=2: prefill done: the two full blocks are registered, the partial B2 is not
    m.cache_blocks(a, a.num_tokens)
    h0, h1 = a.block_hashes
    assert bp.cached_block_hash_to_block == {h0: bp.blocks[0], h1: bp.blocks[1]}
    assert bp.blocks[2].block_hash is None
    # t=3: B hits B0, B1 and gets B3 for its question
    b = req("B", SYS + list(range(100, 112)))
    blocks, n = m.get_computed_blocks(b)
    assert n == 32
    assert [x.block_id for x in m.allocate_slots(b, b.num_tokens - n, n, blocks)] == [3]
    assert refs(m, 0, 1, 3) == [2, 2, 1] and queue_ids(m) == list(range(4, 10))
    # t=4: A finishes: B0, B1 still shared, only the partial (hash-less) B2 joins the queue, at the head
    m.free(a)
    assert refs(m, 0, 1, 2) == [1, 1, 0] and queue_ids(m) == [2, 4, 5, 6, 7, 8, 9]
    # t=5: B finishes in reverse: its partial B3 goes to the head, cached B1, B0 to the tail
    m.free(b)
    assert queue_ids(m) == [3, 2, 4, 5, 6, 7, 8, 9, 1, 0]
    assert set(bp.cached_block_hash_to_block) == {h0, h1}
    # t=6: C needs 5 blocks: B3, B2, B4..B6 (no hash) are popped, nothing evicted
    c = req("C", range(2000, 2070))
    schedule(m, c)
    assert m.get_block_ids("C") == [3, 2, 4, 5, 6] and queue_ids(m) == [7, 8, 9, 1, 0]
    assert set(bp.cached_block_hash_to_block) >= {h0, h1} and bp.stats.evictions == 0
    # t=7: D needs 4 blocks: B7..B9 are reused, then B1 is evicted (H1 dropped), B0/H0 survives
    d = req("D", range(3000, 3060))
    schedule(m, d)
    assert m.get_block_ids("D") == [7, 8, 9, 1] and queue_ids(m) == [0]
    assert h1 not in bp.cached_block_hash_to_block and bp.cached_block_hash_to_block[h0] is bp.blocks[0]
    assert bp.stats.evictions == 1
    # the surviving cache is still a usable prefix
    e = req("E", SYS + [7] * 5)
    assert m.get_computed_blocks(e)[1] == 16
    for r in (c, d):
        m.free(r)
    assert m.num_free_blocks == 10


def test_free_queue_order_keeps_a_reusable_prefix():
    """Issue scenario (pool of 3 blocks of 16): r1 holds a partial block, r2 one full block A; free r2,
    then r1; a 20-token r3 takes two blocks. vLLM's order reuses r1's hash-less block first, so A
    survives and a later lookup of A + 2 tokens hits 16 tokens (all-to-the-tail would evict A: 0)."""
    m = KVCacheManager(3, 16)
    r1 = req("r1", range(500, 512))
    r2 = req("r2", range(100, 116))
    schedule(m, r1)
    schedule(m, r2)
    assert len(m.block_pool.cached_block_hash_to_block) == 1  # A
    m.free(r2)
    m.free(r1)
    r3 = req("r3", range(900, 920))
    assert schedule(m, r3) is not None
    probe = req("probe", list(range(100, 116)) + [1, 2])
    blocks, hit = m.get_computed_blocks(probe)
    assert hit == 16 and blocks[0].block_id == 1 and m.block_pool.stats.evictions == 0
    m.free(r3)
    assert m.num_free_blocks == 3


def test_reverse_free_evicts_chain_tail_first():
    m = KVCacheManager(8, 4)
    a = req("A", range(17), bs=4)  # 4 full blocks + 1 token
    schedule(m, a)
    chain = a.block_hashes
    m.free(a)
    cached = m.block_pool.cached_block_hash_to_block
    evicted = []
    for i in range(8):
        r = req(f"f{i}", [9000 + i] * 3, bs=4)
        schedule(m, r)
        still = [h in cached for h in chain]
        assert still == sorted(still, reverse=True), f"orphan chain after {i + 1} allocations: {still}"
        evicted += [h for h in chain if h not in cached and h not in evicted]
    assert evicted == chain[::-1]  # H3, H2, H1, H0


def test_matching_stops_at_first_miss():
    """H0 evicted while H1 is still cached: a later block hit is unusable (its KV needs positions 0..15)."""
    m = KVCacheManager(6, 4)
    toks = list(range(8))
    r1 = req("R1", toks[:4] + [50], bs=4)
    r2 = req("R2", toks + [60], bs=4)
    assert m.get_computed_blocks(r2) == ([], 0)  # looked up before R1 registers H0
    schedule(m, r1)
    m.allocate_slots(r2, r2.num_tokens)  # computes its own copy of block 0; H0 already cached -> stays uncached
    h0, h1 = r2.block_hashes
    bp = m.block_pool
    assert bp.get_cached_block(h0).block_id == m.get_block_ids("R1")[0]
    assert bp.get_cached_block(h1).block_id == m.get_block_ids("R2")[1]
    m.free(r1)
    schedule(m, req("filler", range(500, 509), bs=4))  # 3 blocks: evicts R1's H0 block
    assert bp.get_cached_block(h0) is None and bp.get_cached_block(h1) is not None
    r3 = req("R3", toks + [70], bs=4)
    assert m.get_computed_blocks(r3) == ([], 0)


def test_last_token_is_never_a_hit():
    m = KVCacheManager(10, 16)
    schedule(m, req("A", SYS))
    blocks, n = m.get_computed_blocks(req("B", SYS))
    assert n == 16 and len(blocks) == 1  # (32 - 1) // 16
    assert m.get_computed_blocks(req("C", SYS + [1]))[1] == 32


def test_cache_salt_separation():
    m = KVCacheManager(20, 16)
    schedule(m, req("A", SYS + [1], cache_salt="tenant-a"))
    assert m.get_computed_blocks(req("B", SYS + [1], cache_salt="tenant-b")) == ([], 0)
    assert m.get_computed_blocks(req("C", SYS + [1])) == ([], 0)
    assert m.get_computed_blocks(req("D", SYS + [1], cache_salt="tenant-a"))[1] == 32


def test_decode_filled_blocks_are_cached():
    m = KVCacheManager(10, 16)
    r = req("R", range(20))
    schedule(m, r)
    assert len(m.block_pool.cached_block_hash_to_block) == 1
    for t in range(20, 40):  # sample a token, then a decode step computes it
        r.append_output_token_ids(t)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert len(m.block_pool.cached_block_hash_to_block) == 2  # tokens 16..31 filled during decode
    blocks, n = m.get_computed_blocks(req("S", list(range(32)) + [5]))
    assert n == 32 and [b.block_id for b in blocks] == m.get_block_ids("R")[:2]


def test_allocate_none_has_no_side_effects_and_hits_are_not_capacity():
    m = KVCacheManager(4, 4)
    a = req("A", range(13), bs=4)
    schedule(m, a)
    m.free(a)  # 4 free blocks, 3 of them cached
    b = req("B", range(17), bs=4)  # 5 blocks: 3 hits + 2 new, but only 1 block is not a hit
    blocks, n = m.get_computed_blocks(b)
    assert n == 12 and m.num_free_blocks == 4
    before = snapshot(m)
    assert m.allocate_slots(b, b.num_tokens - n, n, blocks) is None
    assert snapshot(m) == before
    c = req("C", range(15), bs=4)  # 3 hits + 1 new fits exactly
    assert schedule(m, c) is not None and m.num_free_blocks == 0 and m.usage == 1.0
    before = snapshot(m)
    assert m.allocate_slots(c, 2) is None  # decode growth with an exhausted pool
    assert snapshot(m) == before
    m.free(c)
    assert m.num_free_blocks == 4


def test_lookahead_slots_allocated_not_cached():
    m = KVCacheManager(10, 4)
    r = req("R", range(7), bs=4)
    schedule(m, r, lookahead=5)
    assert len(m.get_block_ids("R")) == 3 and len(m.block_pool.cached_block_hash_to_block) == 1
    r.spec_token_ids = [1, 2, 3]  # spec tokens fill block 1 in slots, but are not real tokens
    r.append_output_token_ids(7)
    assert m.allocate_slots(r, 4) == []  # blocks already there
    assert len(m.block_pool.cached_block_hash_to_block) == 2  # block 1 = tokens 4..7 (real)


def test_external_tokens_defer_caching():
    m = KVCacheManager(10, 4)
    r = req("R", range(13), bs=4)
    new = m.allocate_slots(r, 12, num_external_tokens=8)  # 8 loaded by a connector, 4 computed
    assert len(new) == 3 and not m.block_pool.cached_block_hash_to_block
    r.num_computed_tokens = 12
    m.allocate_slots(r, 1)
    assert len(m.block_pool.cached_block_hash_to_block) == 3


def test_stale_computed_blocks_rejected():
    m = KVCacheManager(4, 4)
    a = req("A", range(9), bs=4)
    schedule(m, a)
    m.free(a)
    b = req("B", range(9), bs=4)
    blocks, n = m.get_computed_blocks(b)
    schedule(m, req("X", range(100, 116), bs=4))  # evicts and reuses every block
    with pytest.raises(ValueError, match="stale"):
        m.allocate_slots(b, b.num_tokens - n, n, blocks)


def test_caching_disabled():
    m = KVCacheManager(10, 16, enable_caching=False)
    schedule(m, req("A", SYS + [1]))
    assert m.get_computed_blocks(req("B", SYS + [1])) == ([], 0)
    assert not m.block_pool.cached_block_hash_to_block
    with pytest.raises(ValueError, match="disabled"):
        m.allocate_slots(req("C", SYS), 1, 16, [m.block_pool.blocks[0]])


def test_request_without_hasher_is_hashed_by_the_manager():
    m = KVCacheManager(10, 16)
    a = Request("A", SYS + [1])
    schedule(m, a)
    assert len(a.block_hashes) == 2
    assert m.get_computed_blocks(Request("B", SYS + [2]))[1] == 32


def test_free_get_block_ids_reset():
    m = KVCacheManager(10, 16)
    a = req("A", SYS + [1])
    schedule(m, a)
    assert m.get_block_ids("A") == [0, 1, 2] and m.get_block_ids("nope") == []
    assert not m.reset_prefix_cache()
    m.free(a)
    m.free(a)  # idempotent
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(req("B", SYS + [1])) == ([], 0)
    assert m.num_free_blocks == 10 and m.usage == 0.0


def test_validation():
    m = KVCacheManager(10, 16)
    r = req("R", SYS)
    with pytest.raises(ValueError, match="num_new_tokens"):
        m.allocate_slots(r, -1)
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        m.allocate_slots(r, 1, num_lookahead_tokens=-2)
    with pytest.raises(ValueError, match="num_external_tokens"):
        m.allocate_slots(r, 1, num_external_tokens=2)
    with pytest.raises(ValueError, match="num_new_computed_tokens=16"):
        m.allocate_slots(r, 1, 16, [])
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(10, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError, match="block_hasher.block_size=8"):
        m.get_computed_blocks(req("S", SYS, bs=8))
    assert m.num_free_blocks == 10 and not m.req_to_blocks

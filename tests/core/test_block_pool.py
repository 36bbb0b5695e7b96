import pytest

from hwkv.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from hwkv.core.request import Request


def ids(blocks):
    return [b.block_id for b in blocks]


def check_links(q: FreeBlockQueue):
    fwd = list(q)
    back, cur = [], q.tail.prev_free_block
    while cur is not q.head:
        back.append(cur)
        cur = cur.prev_free_block
    assert fwd == back[::-1] and len(fwd) == q.num_free_blocks == len(q)


def test_free_queue_ops():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert ids(q) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    q.remove(blocks[4])  # from the middle
    assert ids(q) == [3, 5] and blocks[4].prev_free_block is None
    q.append(blocks[4])
    q.append_n([blocks[0], blocks[2]])
    assert ids(q) == [3, 5, 4, 0, 2]
    check_links(q)
    assert q.popleft_n(0) == []
    assert ids(q.popleft_n(5)) == [3, 5, 4, 0, 2]
    check_links(q)
    with pytest.raises(ValueError, match="empty"):
        q.popleft()
    with pytest.raises(ValueError, match="exceeds"):
        q.popleft_n(1)
    with pytest.raises(ValueError, match="not in the free block queue"):
        q.remove(blocks[1])
    q.append_n([])
    check_links(q)


# --- free queue, prefix-cache map and ref counting ----------------------------------------------


def cache(pool, block, h):
    block.block_hash = h
    pool.cached_block_hash_to_block[h] = block


def test_basic_alloc_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3 and pool.get_usage() == 0.25
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 4 and pool.get_usage() == 0.0


def test_lru_eviction_order():
    pool = BlockPool(4)
    b0, b1, b2 = pool.get_new_blocks(3)
    for i, b in enumerate((b0, b1, b2)):
        cache(pool, b, b"h%d" % i)
    pool.free_blocks([b0, b1, b2])  # cached blocks join the tail: b0 released first -> oldest
    assert ids(pool.free_block_queue) == [3, 0, 1, 2]
    pool.get_new_blocks(1)  # the never-used block 3 goes first
    assert pool.get_new_blocks(1)[0] is b0 and pool.get_cached_block(b"h0") is None


def test_uncached_blocks_are_reused_before_cached_ones():
    """vLLM's order: a freed block without a hash goes to the queue head, a cached one to the tail."""
    pool = BlockPool(5)
    b0, b1, b2, b3 = pool.get_new_blocks(4)
    cache(pool, b1, b"h1")
    cache(pool, b3, b"h3")
    pool.free_blocks([b3, b2, b1, b0])  # a request's table reversed: tail first
    # hash-less b2, b0 at the head in the given order, before the never-used 4; cached b3, b1 at the tail
    assert ids(pool.free_block_queue) == [2, 0, 4, 3, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 0, 4] and pool.stats.evictions == 0
    assert pool.get_cached_block(b"h3") is b3 and pool.get_cached_block(b"h1") is b1


def test_without_caching_freed_blocks_are_reused_first():
    pool = BlockPool(4, enable_caching=False)
    b0, b1 = pool.get_new_blocks(2)
    pool.free_blocks([b1, b0])
    assert ids(pool.free_block_queue) == [1, 0, 2, 3]  # a small hot set of block ids is reused (LIFO)


def test_prefix_cache_hit_and_eviction_on_alloc():
    pool = BlockPool(2)
    (b0,) = pool.get_new_blocks(1)
    cache(pool, b0, b"h0")
    pool.free_blocks([b0])
    (b1,) = pool.get_new_blocks(1)
    cache(pool, b1, b"h1")
    pool.free_blocks([b1])
    assert pool.get_cached_block(b"h0") is b0  # freed but still cached
    (nb,) = pool.get_new_blocks(1)
    assert nb is b0 and nb.block_hash is None
    assert pool.get_cached_block(b"h0") is None and pool.get_cached_block(b"h1") is b1
    assert pool.stats.evictions == 1


def test_touch_removes_from_free_queue_and_sharing():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    cache(pool, b, b"x")
    pool.touch([b])  # second request shares it
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and b not in list(pool.free_block_queue)
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and list(pool.free_block_queue)[-1] is b
    pool.touch([b])  # hit on a free cached block: leaves the queue
    assert b.ref_cnt == 1 and pool.num_free_blocks == 3 and b not in list(pool.free_block_queue)


def test_double_free_and_overallocation_raise():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([b])
    with pytest.raises(ValueError, match="num_blocks=3"):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2


@pytest.mark.parametrize("bad", [0, -3, 2.0, None])
def test_bad_num_blocks(bad):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(bad)


def test_null_block_is_never_handed_out_freed_or_evicted():
    pool = BlockPool(4, use_null_block=True)
    null = pool.null_block
    assert null.block_id == 0 and null.is_null and pool.num_free_blocks == 3
    got = pool.get_new_blocks(3)
    assert null not in got
    pool.touch([null])
    pool.free_blocks([null, *got])
    assert pool.num_free_blocks == 3 and null not in list(pool.free_block_queue)
    assert pool.get_usage() == 0.0
    assert pool.reset_prefix_cache()


def test_cache_full_blocks_and_reset():
    pool = BlockPool(4)
    req = Request("r", [0] * 8)
    req.block_hashes = [b"a", b"b", b"c"]
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert [b.block_hash for b in blocks] == [b"a", b"b", None]
    assert pool.cached_block_hash_to_block == {b"a": blocks[0], b"b": blocks[1]}
    with pytest.raises(ValueError, match="num_full_blocks=4"):
        pool.cache_full_blocks(req, blocks, 2, 4)
    # a duplicate of an already cached hash stays uncached
    (dup,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [dup], 0, 1)
    assert dup.block_hash is None and pool.get_cached_block(b"a") is blocks[0]
    assert not pool.reset_prefix_cache()  # blocks still held
    assert pool.get_cached_block(b"a") is blocks[0]
    pool.free_blocks(reversed([*blocks, dup]))
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and all(b.block_hash is None for b in pool.blocks)


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    req = Request("r", [0] * 8)
    req.block_hashes = [b"a"]
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, blocks, 0, 1)
    assert blocks[0].block_hash is None and not pool.cached_block_hash_to_block


def test_double_free_leaves_the_pool_unchanged():
    pool = BlockPool(6, enable_caching=False)
    a, b = pool.get_new_blocks(2)
    pool.free_blocks([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([a, b])  # b is already free: a must not be half-freed either
    assert a.ref_cnt == 1 and pool.num_free_blocks == 5
    pool.free_blocks([a])
    assert pool.num_free_blocks == 6

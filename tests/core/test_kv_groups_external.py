"""A window group admitting external tokens (a KV connector loads them): the table entries wholly before
the window of the first computed token after them are the null block, never allocated; the admission
check (``num_blocks_short`` of the grouped manager with ``num_external_tokens``) agrees with the
allocation exactly; nothing leaks. Hypothesis over prompt lengths, local hits, external spans, pools."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_groups import GroupedKVCacheManager, KVCacheGroup
from hwkv.core.request import Request

BS = 4


@settings(max_examples=150, deadline=None)
@given(window=st.integers(1, 20), prompt=st.integers(2, 120), warm=st.integers(0, 120), ext=st.integers(1, 120),
       step=st.integers(1, 24), window_blocks=st.integers(2, 12), lookahead=st.integers(0, 3))
def test_external_tokens_allocate_only_the_window(window, prompt, warm, ext, step, window_blocks, lookahead):
    groups = [KVCacheGroup((0,), None, 64), KVCacheGroup((1,), window, window_blocks + 1)]
    m = GroupedKVCacheManager(groups, BS, True)
    tokens = list(range(100, 100 + prompt))
    warm = min(warm, prompt)
    if warm >= BS:  # an earlier request leaves a cached prefix: the new one starts with a local hit
        w = Request("warm", tokens[:warm], block_hasher=make_block_hasher(BS))
        m.allocate_slots(w, warm)  # registers its full blocks (None: a window pool too small, no hit then)
        m.free(w)
    r = Request("r", tokens, block_hasher=make_block_hasher(BS))
    hits, local = m.get_computed_blocks(r)
    ext = min(ext, prompt - 1 - local)
    if ext < 1:
        return
    n = min(step, prompt - local - ext)  # computed in the same step (a synchronous load), maybe 0
    mw = m.managers[1]
    short = mw.num_external_blocks_short(r, n + ext + lookahead, local, hits[1], ext)
    got = m.allocate_slots(r, n + ext, local, hits, lookahead, num_external_tokens=ext)
    assert (got is None) == (short > 0)  # the check is the allocation's
    if got is None:
        return
    full, win = m.get_group_block_ids("r")
    assert len(full) == len(win) == -(-(local + ext + n + lookahead) // BS)  # the tables grow together
    first, hit = mw.first_needed(local + ext), len(hits[1])
    # before the window of the first computed token: the local hit's table (its own nulls and cached blocks,
    # left for the next step to free), then null entries; real blocks from the window on
    assert win[:hit] == [b.block_id for b in hits[1]]
    assert all(b == 0 for b in win[hit:first])
    assert all(b != 0 for b in win[max(first, hit):])
    assert m.num_live_blocks("r")[1] == sum(1 for b in win if b != 0) <= len(win) - first + hit
    m.free(r)
    for mgr in m.managers:  # every group whole
        assert mgr.block_pool.num_free_blocks == mgr.block_pool.num_usable_blocks

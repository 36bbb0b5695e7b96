"""KV-cache groups: window groups free what fell out of the window, prefix hits combine per group,
allocation is all-or-nothing across groups, nothing leaks (a hypothesis trace), and the 32k
Gemma-3-1B figure of docs/hybrid-models.md."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_groups import GroupedKVCacheManager, KVCacheGroup, WindowKVCacheManager, layer_groups
from hwkv.core.request import Request

BS = 16


def req(rid, tokens, bs=BS):
    return Request(rid, list(tokens), block_hasher=make_block_hasher(bs))


def manager(window, full_blocks=64, window_blocks=64, caching=True):
    return GroupedKVCacheManager([KVCacheGroup((0,), None, full_blocks), KVCacheGroup((1,), window, window_blocks)],
                                 BS, caching)


def run(m, r, chunk=None, decode=0):
    """Admit ``r`` with a prefix lookup, prefill it in chunks, then decode ``decode`` tokens; returns the
    hit length and the most live blocks per group seen."""
    blocks, hit = m.get_computed_blocks(r)
    grouped = isinstance(m, GroupedKVCacheManager)
    most = [0] * len(m.managers) if grouped else [0]
    first = True
    while r.num_computed_tokens < r.num_tokens or decode:
        if r.num_computed_tokens >= r.num_tokens:
            r.append_output_token_ids(7)
            decode -= 1
        n = min(chunk or r.num_tokens, r.num_tokens - r.num_computed_tokens - (hit if first else 0))
        got = m.allocate_slots(r, n, hit if first else 0, blocks if first else None)
        assert got is not None
        r.num_computed_tokens += n + (hit if first else 0)
        first = False
        live = m.num_live_blocks(r.request_id) if grouped else [len(m.get_block_ids(r.request_id))]
        most = [max(a, b) for a, b in zip(most, live)]
    return hit, most


def test_layer_groups():
    assert layer_groups([512, 512, None, 512, 128, None]) == [(None, (2, 5)), (128, (4,)), (512, (0, 1, 3))]
    assert layer_groups([None, None]) == [(None, (0, 1))]
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        layer_groups([0, None])


def test_window_group_frees_blocks_out_of_the_window():
    m = manager(window=40)
    r = req("A", range(200))
    _, most = run(m, r, chunk=32, decode=20)
    full, win = m.get_group_block_ids("A")
    assert len(full) == len(win) == -(-220 // BS)
    live = [i for i, b in enumerate(win) if b != 0]
    # the next query (position 220) sees keys from 181 on: blocks 11.. (181 // 16) are live, the rest null
    assert live == list(range(181 // BS, len(win)))
    assert most[1] <= -(-(40 - 1 + 32) // BS) + 1 and most[0] == len(full)
    m.free(r)
    for mm in m.managers:
        assert mm.block_pool.num_free_blocks == mm.block_pool.num_usable_blocks


def test_window_hit_needs_the_window_cached():
    m = manager(window=40, window_blocks=8)
    a = req("A", range(160))
    run(m, a, chunk=32)
    m.free(a)
    # same prompt + more: the full group hits 10 blocks; the window group still has the last ones cached
    b = req("B", list(range(160)) + [1, 2, 3])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 160
    w = m.managers[1]
    assert all(x.is_null for x in blocks[1][:w.first_needed(160)])
    assert [x.block_hash for x in blocks[1][w.first_needed(160):]] == b.block_hashes[w.first_needed(160):10]
    # evict the window group's cached blocks (fill its pool with another request): the hit falls back to 0
    # (no shorter prefix has its window cached either), though the full group still has all 10 blocks
    c = req("C", range(5000, 5000 + 7 * BS))
    run(m, c)
    m.free(c)
    blocks, hit = m.get_computed_blocks(b)
    assert m.managers[0].get_computed_blocks(b)[1] == 160 and hit == 0
    assert blocks == [[], []]


def test_allocation_is_all_or_nothing_across_groups():
    m = manager(window=32, full_blocks=4, window_blocks=64)
    r = req("A", range(100))  # 7 blocks: the full group (3 usable... 4) cannot hold it
    assert m.allocate_slots(r, 100) is None
    assert m.get_group_block_ids("A") == [[], []]
    assert m.managers[1].block_pool.num_free_blocks == m.managers[1].block_pool.num_usable_blocks


def test_stale_window_hit_is_refused():
    m = manager(window=40)
    a = req("A", range(100))
    run(m, a)
    m.free(a)
    b = req("B", list(range(100)) + [5])
    blocks, hit = m.get_computed_blocks(b)
    blocks[1][-1] = m.managers[1].block_pool.blocks[30]
    with pytest.raises(ValueError, match="stale or not a window hit"):
        m.allocate_slots(b, b.num_tokens - hit, hit, blocks)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_trace_no_leak_and_window_bound(data):
    window = data.draw(st.sampled_from([1, 8, 16, 40, 100]), "window")
    chunk = data.draw(st.sampled_from([8, 16, 33, 64]), "chunk")
    m = manager(window=window, full_blocks=400, window_blocks=120)
    w: WindowKVCacheManager = m.managers[1]  # type: ignore[assignment]
    prefixes = [list(range(1000 * i, 1000 * i + data.draw(st.integers(0, 80)))) for i in range(3)]
    live_reqs = []
    for k in range(data.draw(st.integers(1, 8), "requests")):
        tokens = data.draw(st.sampled_from(prefixes)) + [k * 7 + j for j in range(data.draw(st.integers(1, 60)))]
        r = req(f"r{k}", tokens)
        hit, most = run(m, r, chunk=chunk, decode=data.draw(st.integers(0, 20)))
        assert hit % BS == 0 and hit < r.num_tokens
        # live window blocks: at most the window plus one chunk, plus a partial block each side
        assert most[1] <= -(-(window - 1 + chunk) // BS) + 1
        # the table is nulls, then live blocks; frees are lazy (at the next allocation), so every block
        # some query from the last step's start on could see is live
        table = m.get_group_block_ids(r.request_id)[1]
        lo = sum(1 for b in table if b == 0)
        assert all(b == 0 for b in table[:lo]) and all(b != 0 for b in table[lo:])
        assert lo <= w.first_needed(r.num_computed_tokens)
        live_reqs.append(r)
        if data.draw(st.booleans()):
            m.free(live_reqs.pop(data.draw(st.integers(0, len(live_reqs) - 1))))
    for r in live_reqs:
        m.free(r)
    for mm in m.managers:
        assert mm.block_pool.num_free_blocks == mm.block_pool.num_usable_blocks
        assert all(b.ref_cnt == 0 for b in mm.block_pool.blocks if not b.is_null)


def gemma3_32k(context=32768, chunk=2048, decode=64):
    """Blocks held at a ``context``-token Gemma-3-1B request (22 layers with a 512 window, 4 global;
    blocks of 16 tokens, 1 KV head of 256, bf16), by the block managers: grouped vs one full group."""
    from hwkv.core.kv_cache_manager import KVCacheManager

    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = [KVCacheGroup(layers, w, 4096) for w, layers in layer_groups(windows)]
    m = GroupedKVCacheManager(groups, BS)
    r = req("long", range(context))
    _, most = run(m, r, chunk=chunk, decode=decode)
    end = m.num_live_blocks("long")
    plain = KVCacheManager(4096, BS)
    p = req("long", range(context))
    run(plain, p, chunk=chunk, decode=decode)
    block_bytes = BS * 1 * 256 * 2 * 2  # tokens x KV heads x head dim x (K, V) x bf16, per layer
    layer_blocks = sum(len(g.layers) * n for g, n in zip(groups, end))
    full_layer_blocks = 26 * len(plain.get_block_ids("long"))
    return {"groups": [(g.window, len(g.layers)) for g in groups], "live_blocks_end": end, "live_blocks_max": most,
            "full_attention_blocks": len(plain.get_block_ids("long")),
            "grouped_MiB": layer_blocks * block_bytes / 2**20, "full_MiB": full_layer_blocks * block_bytes / 2**20}


def test_gemma3_32k_window_group_holds_the_window():
    f = gemma3_32k(context=4096, chunk=512, decode=8)  # the docs' 32k figure: same code, context=32768
    assert f["groups"] == [(None, 4), (512, 22)]
    assert f["live_blocks_end"][0] == f["full_attention_blocks"] == -(-4104 // BS)
    assert f["live_blocks_end"][1] <= 512 // BS + 1
    assert f["live_blocks_max"][1] <= -(-(511 + 512) // BS) + 1


PREEMPTIONS: list[int] = []


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.data())
def test_scheduler_over_groups_finishes_every_request_and_frees_both_groups(data):
    """The real Scheduler driven by a GroupedKVCacheManager (a full group and a window-8 group, each its
    own pool, either one the tight one): every request finishes with its tokens, the window group never
    holds more than the window plus one chunk per request, and both pools are whole at the end —
    admission and preemption account for both groups."""
    from types import SimpleNamespace

    from hwkv.core.request import RequestStatus
    from hwkv.core.sched_output import ModelRunnerOutput
    from hwkv.core.scheduler import Scheduler, SchedulerConfig

    bs, max_len, window = 4, 48, 8
    budget = data.draw(st.integers(4, 64), "budget")
    cfg = SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 5)), max_num_batched_tokens=budget,
                          max_model_len=max_len, enable_chunked_prefill=True)
    full_blocks, win_blocks = data.draw(st.integers(12, 30), "full"), data.draw(st.integers(13, 30), "win")
    m = GroupedKVCacheManager([KVCacheGroup((0,), None, full_blocks), KVCacheGroup((1,), window, win_blocks)], bs)
    s = Scheduler(cfg, m)
    shared = list(range(500, 520))
    reqs = []
    for i in range(data.draw(st.integers(1, 8), "n")):
        n = data.draw(st.integers(1, 30))
        prompt = (shared[:n] if data.draw(st.booleans()) else []) + [1000 * (i + 1) + j for j in range(n)]
        prompt = prompt[:n]
        reqs.append(Request(f"r{i}", prompt, SimpleNamespace(stop_token_ids=[], ignore_eos=True),
                            block_hasher=make_block_hasher(bs), max_tokens=data.draw(st.integers(1, max_len - n))))
        s.add_request(reqs[-1])
    preempted = 0
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        preempted += len(so.preempted_req_ids)
        for r in s.running:
            live = m.num_live_blocks(r.request_id)[1]
            assert live <= -(-(window - 1 + budget) // bs) + 1, (r.request_id, live)
        done = {rid: [7] for rid in so.num_scheduled_tokens
                if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens}
        s.update_from_output(so, ModelRunnerOutput(done))
    PREEMPTIONS.append(preempted)
    assert not s.has_unfinished_requests(), "workload did not finish"
    for r in reqs:
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.output_token_ids == [7] * r.max_tokens
    for mm in m.managers:
        assert mm.block_pool.num_free_blocks == mm.block_pool.num_usable_blocks


def test_scheduler_over_groups_preempted_somewhere():
    """The trace above reaches preemption (a pool, either group's, ran short) in some of its examples."""
    if not PREEMPTIONS:
        test_scheduler_over_groups_finishes_every_request_and_frees_both_groups()
    assert sum(1 for p in PREEMPTIONS if p) >= 3, PREEMPTIONS

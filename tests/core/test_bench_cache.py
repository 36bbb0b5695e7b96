import argparse
import json

from hwkv.bench import cache


def test_bench_cache_smoke(tmp_path, capsys):
    p = argparse.ArgumentParser()
    cache.add_arguments(p)
    out = tmp_path / "cache.json"
    args = p.parse_args(["--prompt-tokens", "1024", "--num-running", "8", "--repeats", "3", "--out", str(out)])
    assert cache.run(args) == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) >= {"hash_us_per_block", "alloc_free_us_per_block", "lookup_full_hit_us",
                                   "lookup_full_miss_us", "step_decodes_ms"}
    assert all(v > 0 for v in doc["results"].values())
    assert doc["peer_vllm_0_33_quoted"]["hash_us_per_block"] == 1.85
    assert "peer" in capsys.readouterr().out


def test_duplicate_caching_comparison_runs_both_pools(tmp_path, capsys):
    """The duplicate-keeping pool is a faithful variant: same traces finish, never fewer cached copies."""
    p = argparse.ArgumentParser()
    cache.add_arguments(p)
    args = p.parse_args(["--dup-traces", "20"])
    res = cache.bench_duplicates(args)
    a, b = res["totals"]["hwkv"], res["totals"]["vllm_dup"]
    assert res["traces"] == 20 and a["queries"] > a["hits"] > 0 and b["hits"] > 0
    assert res["traces_dup_hits_more"] + res["traces_dup_hits_fewer"] <= 20


def test_dup_pool_keeps_the_prefix_when_one_copy_is_evicted():
    from hwkv.core.block_pool import BlockPool
    from hwkv.core.request import Request

    pool = cache.DupBlockPool(3)
    x, y = pool.get_new_blocks(2)
    r = Request("r", [1, 2, 3, 4])
    r.block_hashes = [b"h"]
    pool.cache_full_blocks(r, [x], 0, 1)
    pool.cache_full_blocks(r, [y], 0, 1)  # a second copy of h
    assert pool.get_cached_block(b"h") is x and y.block_hash == b"h"
    pool.free_blocks([x, y])
    pool.get_new_blocks(2)  # the never-used block, then x: x's eviction promotes y
    assert pool.get_cached_block(b"h") is y
    plain = BlockPool(3)
    x, y = plain.get_new_blocks(2)
    plain.cache_full_blocks(r, [x], 0, 1)
    plain.cache_full_blocks(r, [y], 0, 1)
    assert y.block_hash is None and plain.get_cached_block(b"h") is x  # hwkv: the copy stays uncached

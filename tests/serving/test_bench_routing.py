"""`hwkv bench routing` and `hwkv bench pool-restart` at toy scale: both run end to end (real server,
router and mooncake processes), write their result files, and leave no process behind."""

from __future__ import annotations

import argparse
import json

import pytest

from hwkv.bench import pool_restart, routing
from hwkv.testing.mooncake import skip_unless_mooncake


def _args(mod, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    return p.parse_args(argv)


@pytest.mark.slow
def test_bench_routing_toy(tmp_path):
    args = _args(routing, ["--instances", "2", "--tenants", "4", "--system-len", "96-160", "--suffix-len", "8",
                           "--requests", "24", "--concurrency", "2", "--kv-share", "1.0", "--workdir",
                           str(tmp_path / "models"), "--out-dir", str(tmp_path)])
    assert routing.run(args) == 0
    doc = json.loads(next(tmp_path.glob("routing-tiny-cpu-x2-*.json")).read_text())
    rr, ca = doc["results"]["round_robin"], doc["results"]["cache_aware"]
    assert rr["completed"] == ca["completed"] == 24 and rr["failed"] == ca["failed"] == 0
    assert sum(rr["routed"]) == sum(ca["routed"]) == 24 and rr["routed"] == [12, 12]
    assert ca["prompt_tokens"] > 0 and ca["prefix_hit_rate"] >= rr["prefix_hit_rate"]
    assert doc["isolated"]["miss_ttft_ms"] > 0 and doc["isolated"]["hit_ttft_ms"] > 0  # the floor, alone


@pytest.mark.slow
def test_bench_pool_restart_toy(tmp_path):
    skip_unless_mooncake()
    args = _args(pool_restart, ["--prompt-len", "256", "--repeats", "1", "--capacity-mb", "64", "--staging-mb", "8",
                                "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path)])
    assert pool_restart.run(args) == 0
    res = json.loads(next(tmp_path.glob("pool-restart-tiny-cpu-*.json")).read_text())["results"]
    assert res["tokens_identical"] and res["runs"]["pool-holder"][0]["loaded_bytes"] > 0
    assert res["runs"]["pool-tcp"][0]["loaded_bytes"] == res["runs"]["pool-holder"][0]["loaded_bytes"]
    assert res["runs"]["none"][0]["loaded_bytes"] == 0
    for via in ("pool-holder", "pool-tcp"):  # the measured request's load split (the warm request's excluded)
        tm = res["runs"][via][0]["timing"]
        assert tm["load_jobs"] == 1 and 0 < tm["load_store_s"] <= tm["load_wall_s"] <= res["runs"][via][0]["ttft_s"]
        # the warm-up has the measured request's shape: it loads its own 256-token prefix too
        assert res["runs"][via][0]["lookup_hit_tokens"] == 2 * 256 and res["runs"][via][0]["failed_loads"] == 0
        assert 0 < tm["lookup_s"] < res["runs"][via][0]["ttft_s"]
    # one engine per --via: recompute, then the same prompt from the pool, tokens equal
    args = _args(pool_restart, ["--prompt-len", "256", "--capacity-mb", "64", "--staging-mb", "8", "--one-process",
                                "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path)])
    assert pool_restart.run(args) == 0
    one = json.loads(next(tmp_path.glob("pool-restart-one-process-tiny-cpu-*.json")).read_text())["results"]
    for via in ("holder", "tcp"):
        assert one[via]["loaded_bytes"] > 0 and one[via]["runs"]["pool"]["timing"]["load_jobs"] == 1
        assert one[via]["runs"]["none"]["timing"]["load_jobs"] == 0
        # 288 tokens: the device-cache hit and the pool both reuse 17 blocks, so the tokens are checked
        # against the hit's (same kernels for the tail)
        assert one[via]["tokens_checked_against"] == "hit" and one[via]["ttft_device_hit_ms"] > 0
    # a prompt longer than the model's positions is refused before any engine starts
    args = _args(pool_restart, ["--prompt-len", "1000000", "--workdir", str(tmp_path / "models"),
                                "--out-dir", str(tmp_path)])
    assert pool_restart.run(args) == 2

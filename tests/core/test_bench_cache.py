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

"""The GPU pool-with-groups script (hwkv_cuda.bench.hybrid_pool) stays runnable: its CPU smoke shape through
the cpu backend (direct gets), groups, bytes, a lost chunk, margin rule and pools checked."""

import json

import pytest

pytest.importorskip("transformers")


def test_hybrid_pool_script_runs_on_cpu(tmp_path):
    from hwkv_cuda.bench.hybrid_pool import main

    out = tmp_path / "pool.json"
    assert main(["--shape", "gemma3-tiny", "--backend", "cpu", "--dtype", "float32", "--modes", "direct",
                 "--prompts", "2", "--prompt-len", "60", "--tokens", "4", "--num-kv-blocks", "64",
                 "--workdir", str(tmp_path), "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["modes"]
    assert [g["window"] for g in r["kv_groups"]] == [None, 16] and r["pools_whole"] and r["ok"]
    assert r["loaded_bytes"] == r["expected_grouped_bytes"] < r["one_group_bytes"]  # the window group's window only
    assert r["identical_to_plain"] == "2/2" and r["margin_rule"]["passes"]
    assert r["lost_chunk"]["load_failures"] == 1 and r["lost_chunk"]["identical_to_plain"]

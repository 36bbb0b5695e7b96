"""The GPU parity script (hwkv_cuda.bench.hybrid_parity) stays runnable: its CPU smoke shape through
the cpu backend, margin rule and HF greedy comparison included."""

import json

import pytest

pytest.importorskip("transformers")


def test_hybrid_parity_script_runs_on_cpu(tmp_path):
    from hwkv_cuda.bench.hybrid_parity import main

    out = tmp_path / "hybrid.json"
    assert main(["--shape", "gemma3-tiny", "--backend", "cpu", "--dtype", "float32", "--prompts", "2",
                 "--prompt-len", "24", "--tokens", "4", "--workdir", str(tmp_path), "--out", str(out),
                 "--memory-len", "256", "--spec-shapes", "gemma3-tiny"]) == 0
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert "error" not in doc["memory"], doc["memory"]
    assert run["margin_rule"]["passes"] and run["attention_features"] == ["sliding_window"]
    assert min(run["prompt_lens"]) > run["window"]  # the window matters
    assert [g["window"] for g in run["kv_groups"]] == [None, 16]
    mem = doc["memory"]  # 256 tokens, window 16: the window group holds a window and one step, not the context
    full, win = mem["most_live_blocks_per_group"]
    assert full == 256 // mem["block_size"] and win < full and mem["ratio"] > 1
    assert mem["live_blocks_per_group_last_step"][1] <= -(-16 // mem["block_size"]) + 1
    spec = run["spec_draft_self"]  # the target as its own draft with groups: the plain run's tokens
    assert spec["kv_groups"] == run["kv_groups"] and spec["draft_tokens"] > 0 and spec["pools_whole"]
    assert spec["identical_to_plain_run"] == "2/2" and spec["margin_rule"]["passes"]

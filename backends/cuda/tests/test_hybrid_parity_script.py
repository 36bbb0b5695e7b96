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
                 "--memory-len", "256"]) == 0
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

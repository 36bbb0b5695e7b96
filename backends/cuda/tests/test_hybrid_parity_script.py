"""The GPU parity script (hwkv_cuda.bench.hybrid_parity) stays runnable: its CPU smoke shape through
the cpu backend, margin rule and HF greedy comparison included."""

import json

import pytest

pytest.importorskip("transformers")


def test_hybrid_parity_script_runs_on_cpu(tmp_path):
    from hwkv_cuda.bench.hybrid_parity import main

    out = tmp_path / "hybrid.json"
    assert main(["--shape", "gemma3-tiny", "--backend", "cpu", "--dtype", "float32", "--prompts", "2",
                 "--prompt-len", "24", "--tokens", "4", "--workdir", str(tmp_path), "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["margin_rule"]["passes"] and run["attention_features"] == ["sliding_window"]
    assert min(run["prompt_lens"]) > run["window"]  # the window matters

"""The teacher-forced bf16 statistics script (hwkv_cuda.bench.teacher_forced) stays runnable on the CPU."""

import json

import pytest

pytest.importorskip("transformers")


def test_teacher_forced_script_runs_on_cpu(tmp_path):
    from hwkv_cuda.bench.teacher_forced import main

    out = tmp_path / "tf.json"
    assert main(["--shape", "gemma3-tiny", "--backend", "cpu", "--seeds", "0", "--prompts", "1", "--prompt-len", "40",
                 "--workdir", str(tmp_path), "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["positions"] == 40 and run["hwkv_bf16"]["argmax_differs"] <= 40
    assert 0 <= run["hwkv_vs_hf_bf16_mean_abs_diff"] < 1

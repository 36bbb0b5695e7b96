"""The GPU P/D-with-groups script (hwkv_cuda.bench.hybrid_pd) stays runnable: its CPU smoke shape through
the cpu backend over tcp, groups, bytes, margin rule and pools checked."""

import json

import pytest

from hwkv.testing.mooncake import skip_unless_mooncake

pytest.importorskip("transformers")
skip_unless_mooncake(allow_module_level=True)


def test_hybrid_pd_script_runs_on_cpu(tmp_path):
    from hwkv_cuda.bench.hybrid_pd import main

    out = tmp_path / "pd.json"
    assert main(["--shape", "gemma3-tiny", "--backend", "cpu", "--dtype", "float32", "--setups", "pull:tcp",
                 "--prompts", "2", "--prompt-len", "40", "--tokens", "4", "--num-kv-blocks", "64",
                 "--workdir", str(tmp_path), "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["setups"]
    assert [g["window"] for g in r["kv_groups"]] == [None, 16] and r["pools_whole"] and r["ok"]
    assert r["loaded_bytes"] == r["expected_grouped_bytes"] < r["one_group_bytes"]  # the window group's window only
    assert r["identical_to_plain"] == "2/2" and r["margin_rule"]["passes"]

"""The GPU connector-with-groups scripts stay runnable on their CPU smoke shape through the cpu backend:
hwkv_cuda.bench.hybrid_pool (direct gets, a lost chunk) and hwkv_cuda.bench.hybrid_pd (pull over tcp), each
with groups, bytes, margin rule and pools checked."""

import importlib
import json

import pytest

from hwkv.testing.mooncake import skip_unless_mooncake

pytest.importorskip("transformers")


@pytest.mark.parametrize("bench, key, case, prompt_len", [
    ("hybrid_pool", "modes", ["--modes", "direct"], 60),
    ("hybrid_pd", "setups", ["--setups", "pull:tcp", "--fail-part", "3", "--part-tokens", "16"], 40),
])
def test_hybrid_connector_script_runs_on_cpu(tmp_path, bench, key, case, prompt_len):
    if bench == "hybrid_pd":
        skip_unless_mooncake()  # the tcp protocol is Mooncake's transfer engine
    main = importlib.import_module(f"hwkv_cuda.bench.{bench}").main
    out = tmp_path / "out.json"
    assert main(["--shape", "gemma3-tiny", "--backend", "cpu", "--dtype", "float32", *case, "--prompts", "2",
                 "--prompt-len", str(prompt_len), "--tokens", "4", "--num-kv-blocks", "64",
                 "--workdir", str(tmp_path), "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())[key]
    assert [g["window"] for g in r["kv_groups"]] == [None, 16] and r["pools_whole"] and r["ok"]
    assert r["loaded_bytes"] == r["expected_grouped_bytes"] < r["one_group_bytes"]  # the window group's window only
    assert r["identical_to_plain"] == "2/2" and r["margin_rule"]["passes"]
    if bench == "hybrid_pool":
        assert r["lost_chunk"]["load_failures"] == 1 and r["lost_chunk"]["identical_to_plain"]
    else:  # parts [0,16) [16,32) [32,39): the third fails, the window-16 group's block [16,32) had landed
        f = r["failed_part"]
        assert f["parts"] == [[0, 16], [16, 32], [32, 39]] and f["reads"] == 3 and f["identical_to_plain"]
        assert f["load_kept_tokens"] == f["cached_tokens_after_failure"] == 32

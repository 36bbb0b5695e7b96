"""`hwkv bench offload` runs end to end on the CPU backend with a tiny model (the GPU numbers come
from the same code)."""

import json

from hwkv import cli


def test_bench_offload_on_cpu(tmp_path):
    rc = cli.main(["bench", "offload", "--backend", "cpu", "--model", "tiny", "--dtype", "float32",
                   "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path), "--copy-blocks", "64",
                   "--run-blocks", "1,8", "--prompt-len", "256", "--ttft-reps", "1", "--decode-requests", "4",
                   "--decode-prompt", "32", "--decode-tokens", "8", "--cpu-gb", "0.05",
                   "--preempt-requests", "4"])
    assert rc == 0
    res = json.loads((tmp_path / "offload-cpu-tiny.json").read_text())
    assert {r["run_blocks"] for r in res["copy"]} == {1, 8} and all(r["d2h_GBps"] > 0 for r in res["copy"])
    t = res["ttft"]
    assert t["host_hit_tokens"] >= 256 - 16 - 16  # the prefix's full blocks came from the tier
    # the loaded TTFT's breakdown: the same prompt on a device prefix hit, the load copies' time
    assert t["ttft_device_hit_s"] > 0 and t["load_copy_s"] > 0 and 0 < t["load_issue_s"] < t["ttft_loaded_s"]
    assert res["decode"]["tok_per_s_on"] > 0 and res["decode"]["tok_per_s_off"] > 0
    assert res["decode"]["connector_host_us_per_step"] > 0
    p = res["preempt"]  # 4 requests of 3 blocks in a pool of 4: preemptions, stored and loaded back
    assert p["device_blocks"] == 4 and p["off"]["preemptions"] > 0 and p["on"]["preemptions"] > 0
    assert p["on"]["preempted_store_blocks"] > 0 and p["on"]["external_hit_tokens"] > 0
    assert p["on"]["tokens_computed"] < p["off"]["tokens_computed"] and p["tokens_identical"]

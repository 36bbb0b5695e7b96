"""`hwkv generate` (incl. the README's --demo) and `hwkv bench scheduler`, run in-process."""

from __future__ import annotations

import argparse
import json

from hwkv.bench import scheduler as bench_scheduler
from hwkv.commands import generate


def test_generate_demo_json(tmp_path, capsys):
    assert generate.main(["--demo", "--demo-dir", str(tmp_path), "--max-tokens", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    outs = doc["outputs"]
    assert len(outs) == 3 * len(generate.DEMO_PROMPTS)
    assert all(len(o["token_ids"]) == 4 and o["finish_reason"] == "length" for o in outs)
    # Round 3 repeats round 2 exactly: same tokens, served from the prefix cache.
    n = len(generate.DEMO_PROMPTS)
    assert [o["token_ids"] for o in outs[n : 2 * n]] == [o["token_ids"] for o in outs[2 * n :]]
    st = doc["stats"]
    assert st["prefix_cache_hits"] > 0 and st["num_free_blocks"] == st["num_kv_blocks"]


def test_generate_model_dir_and_errors(tmp_path, capsys):
    assert generate.main(["--demo", "--demo-dir", str(tmp_path), "--max-tokens", "2", "--json"]) == 0
    capsys.readouterr()
    model = str(tmp_path / "hwkv" / "demo-llama")
    assert generate.main(["--model", model, "--prompt", "Hello", "--max-tokens", "3", "--num-kv-blocks", "32"]) == 0
    out = capsys.readouterr().out
    assert "'Hello'" in out and "engine stats" in out
    assert generate.main(["--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert generate.main(["--model", model, "--prompt", "x", "--num-kv-blocks", "8", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert generate.main([]) == 2


def test_bench_scheduler_smoke(tmp_path, capsys):
    p = argparse.ArgumentParser()
    bench_scheduler.add_arguments(p)
    out = tmp_path / "s.json"
    args = p.parse_args(["--num-decodes", "16", "--prompt-len", "40", "--long-prompt-len", "200",
                         "--max-num-batched-tokens", "64", "--steps", "20", "--warmup", "2", "--out", str(out)])
    assert bench_scheduler.run(args) == 0
    doc = json.loads(out.read_text())
    for name in ("decode", "mixed"):
        assert doc["results"][name]["step"]["median_ms"] > 0
    assert doc["results"]["mixed"]["mean_prefill_chunks_per_step"] >= 1
    assert "vLLM" in capsys.readouterr().out

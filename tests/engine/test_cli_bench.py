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


def test_generate_chat_uses_the_template(tmp_path, capsys):
    from hwkv.model.tiny import write_tiny_model
    from hwkv.model.tokenizer import Tokenizer

    model = write_tiny_model(tmp_path / "m")
    args = ["--model", str(model), "--prompt", "Hello", "--max-tokens", "3", "--num-kv-blocks", "32", "--json",
            "--ignore-eos"]
    assert generate.main([*args, "--chat"]) == 0
    chat = json.loads(capsys.readouterr().out)["outputs"][0]
    assert generate.main(args) == 0
    plain = json.loads(capsys.readouterr().out)["outputs"][0]
    assert chat["prompt"] == plain["prompt"] == "Hello" and chat["token_ids"] != plain["token_ids"]
    # the chat prompt's tokens are the template's rendering, encoded without an extra BOS
    import hwkv

    tok = Tokenizer.from_dir(model)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello"}]), add_special_tokens=False)
    e = hwkv.Engine(model=str(model), backend="cpu", num_kv_blocks=32)
    want = e.generate([ids], hwkv.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert chat["token_ids"] == want[0].token_ids


def test_bench_defaults_and_kv_dtype_on_cpu(tmp_path):
    """`hwkv bench defaults` and `hwkv bench kv-dtype` end to end on the tiny model: their shared setup
    (bench.common.engine_bench), the result header (commit, command) and the figures they write."""
    from hwkv.bench import defaults as bench_defaults
    from hwkv.bench import kv_dtype as bench_kv_dtype

    common = ["--model", "tiny", "--backend", "cpu", "--dtype", "bfloat16", "--workdir", str(tmp_path / "m")]
    p = argparse.ArgumentParser()
    bench_defaults.add_arguments(p)
    out = tmp_path / "defaults.json"
    assert bench_defaults.run(p.parse_args([*common, "--num-requests", "2", "--input-len", "8", "--output-len", "3",
                                            "--b1-tokens", "4", "--profile", "--out", str(out)])) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "defaults" and doc["non_default_engine_args"] == {} and "command" in doc
    steps = {b: doc["decode_profile"][f"batch {b}"]["step"] for b in (2, 1)}  # --profile: the decode step taken apart
    assert all(s["step_wall"] > 0 and s["schedule"] > 0 for s in steps.values())
    assert doc["resolved"]["max_num_batched_tokens"] == 2048  # the host row of the defaults table
    assert doc["offline"]["hwkv"]["output_tokens"] == 6 and doc["offline"]["roofline_fraction"] > 0
    p = argparse.ArgumentParser()
    bench_kv_dtype.add_arguments(p)
    out = tmp_path / "kv.json"
    assert bench_kv_dtype.run(p.parse_args([*common, "--decode-batch", "2", "--decode-context", "64",
                                            "--agree-prompts", "2", "--agree-prompt-len", "8", "--agree-tokens", "3",
                                            "--profile", "--out", str(out)])) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "kv-dtype" and set(doc["runs"]) == {"auto", "fp8"}
    assert doc["ratios"]["bytes_per_block"] == 0.5
    assert doc["runs"]["auto"]["first_divergence"] == [None, None]
    assert all(r["decode"]["batch"] == 2 for r in doc["runs"].values())
    # --profile: kernel tables of the graph replay and the eager forward (no GPU kernels on the CPU)
    assert all(set(r["decode"]["kernels"]) == {"graph", "eager"} for r in doc["runs"].values())

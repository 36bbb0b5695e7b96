"""`hwkv generate` before loading anything, the demo model cache, threads; bench output paths."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

import hwkv
from hwkv.bench import results_dir
from hwkv.bench import scheduler as bench_scheduler
from hwkv.commands import generate


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_generate_without_prompt_fails_before_loading_the_model(tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(hwkv, "Engine", no_load)
    assert generate.main(["--model", str(tmp_path / "anything")]) == 2
    assert "give at least one --prompt" in capsys.readouterr().err
    assert generate.main(["--model", str(tmp_path), "--prompt", "x", "--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_an_interrupted_first_demo_run_does_not_break_later_runs(tmp_path, monkeypatch, capsys):
    import hwkv.model.tiny as tm

    real = tm.write_tiny_model

    def interrupted(path, **kw):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("{}")  # what an interrupted write leaves behind
        raise KeyboardInterrupt

    monkeypatch.setattr(tm, "write_tiny_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        generate.main(["--demo", "--demo-dir", str(tmp_path), "--max-tokens", "2", "--json"])
    root = generate.demo_model_dir(str(tmp_path))
    assert not root.exists()  # nothing half-written at the final path
    # An older hwkv wrote in place: a directory with config.json but no weights must be rebuilt.
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    monkeypatch.setattr(tm, "write_tiny_model", real)
    capsys.readouterr()
    assert generate.main(["--demo", "--demo-dir", str(tmp_path), "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == str(root)
    assert (root / "model.safetensors").is_file() and (root / "hwkv-demo.json").is_file()
    leftovers = [p.name for p in root.parent.iterdir() if p.name != "demo-llama"]
    assert all(name.startswith(".demo-llama-") for name in leftovers)  # only the interrupted run's temp dir
    mtime = (root / "model.safetensors").stat().st_mtime_ns
    assert generate.main(["--demo", "--demo-dir", str(tmp_path), "--max-tokens", "2", "--json"]) == 0
    assert (root / "model.safetensors").stat().st_mtime_ns == mtime  # complete: reused, not rewritten


def test_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ns = argparse.Namespace(threads=None, demo=True, model=None)
    assert generate.set_threads(ns) == 1  # the demo's matrices are tiny: one thread
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert generate.set_threads(ns) == 2  # the user's choice wins
    assert generate.set_threads(argparse.Namespace(threads=1, demo=False, model="m")) == 1


def test_bench_results_go_to_the_checkout_whatever_the_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("HWKV_BENCH_RESULTS", raising=False)
    monkeypatch.chdir(tmp_path)
    repo = Path(hwkv.__file__).resolve().parents[1]
    assert results_dir() == repo / "bench" / "results"
    out = tmp_path / "elsewhere"
    monkeypatch.setenv("HWKV_BENCH_RESULTS", str(out))
    p = argparse.ArgumentParser()
    bench_scheduler.add_arguments(p)
    args = p.parse_args(["--num-decodes", "4", "--prompt-len", "20", "--long-prompt-len", "40",
                         "--max-num-batched-tokens", "32", "--steps", "3", "--warmup", "1"])
    assert bench_scheduler.run(args) == 0
    (written,) = out.iterdir()
    assert written.name.startswith("scheduler-cpu-") and not (tmp_path / "bench").exists()
    assert os.getcwd() == str(tmp_path)

"""`hwkv bench spec` runs end to end on the CPU backend with the tiny shape and writes its results."""

from __future__ import annotations

import argparse
import json

from hwkv.bench import spec


def test_bench_spec_cpu_tiny(tmp_path) -> None:
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--backend", "cpu", "--dtype", "float32", "--tokens", "12",
                         "--prompt-len", "40", "--batch-sizes", "1,2", "--scenarios", "ngram,self,layer1,eagle",
                         "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path / "out")])
    assert spec.run(args) == 0
    (res,) = (tmp_path / "out").glob("spec-cpu-tiny-*.json")
    rows = json.loads(res.read_text())["rows"]
    assert {(r["scenario"], r["batch"]) for r in rows} == {(s, b) for s in ("ngram", "self", "layer1", "eagle")
                                                            for b in (1, 2)}
    assert all(r["identical_to_baseline"] for r in rows)  # greedy: speculation changes nothing but speed
    assert all(r["acceptance_rate"] > 0.9 for r in rows if r["scenario"] == "self")
    assert (res.with_suffix(".md")).read_text().count("| self |") == 2


def test_bench_spec_refuses_unknown_scenario(tmp_path) -> None:
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--backend", "cpu", "--scenarios", "medusa",
                         "--workdir", str(tmp_path)])
    assert spec.run(args) == 2


def test_bench_spec_host_profile(capsys) -> None:
    """``--host``: the host path per step of decode / ngram / self on the CPU stub, one table row each."""
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    args = p.parse_args(["--host", "--batch-sizes", "2", "--repeat", "1", "-k", "3"])
    assert spec.run(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "scenario" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["decode", "ngram", "self"]
    self_row = rows[2].split("|")
    assert float(self_row[4]) == 4.0 and float(self_row[5]) == 1.0  # draft = target: k + 1 tokens, all accepted


def test_bench_spec_on_emulated_graphs_reports_replay_times(tmp_path, monkeypatch) -> None:
    """With a backend that captures graphs (emulated on the CPU) every row carries the device time of a
    decode and a verify graph replay and the per-step wall times (the GPU run's columns)."""
    from hwkv.reference.graphs import GraphCpuBackend

    monkeypatch.setattr(spec, "backend", lambda name: GraphCpuBackend())
    p = argparse.ArgumentParser()
    spec.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--backend", "cpu", "--dtype", "float32", "--tokens", "12",
                         "--prompt-len", "24", "--batch-sizes", "1", "--scenarios", "ngram,eagle",
                         "--engine-args", '{"fuse_elementwise": false}',
                         "--workdir", str(tmp_path / "models"), "--out-dir", str(tmp_path / "out")])
    assert spec.run(args) == 0
    (res,) = (tmp_path / "out").glob("spec-cpu-tiny-*.json")
    rows = json.loads(res.read_text())["rows"]
    assert [r["scenario"] for r in rows] == ["ngram", "eagle"] and all(r["identical_to_baseline"] for r in rows)
    for r in rows:
        assert r["decode_graph_ms"] > 0 and r["verify_graph_ms"] > 0
        assert r["step_ms"] >= r["step_ms_excl_propose"] > 0 and r["baseline_step_ms"] > 0

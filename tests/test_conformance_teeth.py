"""The conformance suite has teeth: deliberately broken backends, installed as a real plugin
distribution, FAIL exactly the tests that cover their bug (and pass the rest); the runner refuses
certification overrides; statuses ERROR / TIMEOUT / NOT_SUPPORTED are reported as such."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

import conformance
from conformance.report import ReportPlugin, markdown
from conformance.tolerances import ToleranceTable
from hwkv import plugins

BROKEN = Path(__file__).parent / "broken_backends" / "hwkv_teeth_broken.py"
# Kernel checks at one block size in float32: enough to show each bug, cheap enough to run 5 times.
KERNEL = ["-k", "float32 and bs16 and (test_attention or test_write_kv) and not long_context and not features "
          "and not minus_one_positions"]
# attention 4 states x 4 GQA x 2 head sizes + production + spec-decode verify + KV write 4 patterns x 2 head sizes
N_KERNEL = 42


def attention(i: str) -> bool:
    return i.startswith("test_attention.py::") or "::test_attention_verify_queries[" in i


@pytest.fixture(scope="module")
def teeth(tmp_path_factory):
    """Install distribution ``hwkv-teeth`` (entry point ``teeth`` → ``hwkv_teeth_broken``)."""
    site = tmp_path_factory.mktemp("site")
    shutil.copy(BROKEN, site / BROKEN.name)
    info = site / "hwkv_teeth-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hwkv-teeth\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[hwkv.backends]\nteeth = hwkv_teeth_broken\n")
    saved = {k: os.environ.pop(k) for k in ("HWKV_PLUGINS", "HWKV_DISABLED_PLUGINS") if k in os.environ}
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    plugins.reset()
    yield
    sys.path.remove(str(site))
    sys.modules.pop("hwkv_teeth_broken", None)
    os.environ.update(saved)
    plugins.reset()


def statuses(report: dict) -> dict[str, str]:
    return {t["id"]: t["status"] for t in report["tests"]}


def run_kernel(name: str, **kw) -> dict[str, str]:
    report = conformance.run(name, pytest_args=KERNEL, **kw)
    got = statuses(report)
    assert len(got) == N_KERNEL, f"kernel selection changed: {len(got)} tests"
    return got


def test_correct_naive_backend_passes(teeth, tmp_path):
    report = conformance.run("teeth-ok", report_dir=tmp_path, pytest_args=KERNEL)
    assert set(statuses(report).values()) == {"PASS"}
    # the report: both files, the required fields, consistent counts
    data = json.loads((tmp_path / "conformance.json").read_text())
    for key in ("suite_version", "hwkv_version", "backend", "backend_dist", "backend_version", "device", "seed",
                "certified", "summary", "tests", "tolerance_table"):
        assert key in data, key
    assert (data["backend"], data["backend_dist"], data["backend_version"]) == ("teeth-ok", "hwkv-teeth", "0.0.1")
    assert data["certified"] is False, "a run without --certify is never certified"
    assert data["summary"]["PASS"] == data["summary"]["total"] == len(data["tests"]) == N_KERNEL
    t = next(t for t in data["tests"] if t["id"].startswith("test_attention.py::"))
    assert set(t) >= {"id", "capability", "status", "reason", "max_abs_err", "max_rel_err", "tolerance"}
    assert t["capability"].startswith("attention/") and t["tolerance"] == "atol=2e-05 rtol=0.0001"
    assert 0 <= t["max_abs_err"] <= 2e-5
    md = (tmp_path / "conformance.md").read_text()
    assert "backend `teeth-ok`" in md and f"| {N_KERNEL} |" in md


def test_cross_layer_layout_passes(teeth):
    """The suite reads K/V through the layout definitions, so a correct CROSS_LAYER backend passes."""
    got = run_kernel("teeth-crosslayer")
    assert set(got.values()) == {"PASS"}
    # graphs are left out: the teeth backends declare none (NOT_SUPPORTED there says nothing of the layout)
    got = statuses(conformance.run("teeth-crosslayer",
                                   pytest_args=["-k", "test_device and not graph_replay and not graph_captures"]))
    assert got and set(got.values()) == {"PASS"}, {k: v for k, v in got.items() if v != "PASS"}


@pytest.mark.parametrize(
    "bug, expect_fail",
    [
        ("slot", lambda i: i.startswith("test_kv_write.py::") and ("minus_one" in i or "production" in i)),
        ("causal", lambda i: attention(i) and ("-prefix-" in i or "-mixed-" in i or "production" in i
                                                 or "verify" in i)),
        ("gqa", lambda i: attention(i) and ("-gqa4]" in i or "-gqa8]" in i or "production" in i or "verify" in i)),
        ("blockorder", attention),
    ],
)
def test_broken_backend_fails_exactly_its_tests(teeth, bug, expect_fail):
    got = run_kernel(f"teeth-{bug}")
    want_fail = {i for i in got if expect_fail(i)}
    assert want_fail, "the expectation selects no test"
    failed = {i for i, s in got.items() if s == "FAIL"}
    assert failed == want_fail, f"FAIL but not expected: {sorted(failed - want_fail)[:5]}; " \
        f"expected FAIL: {sorted(want_fail - failed)[:5]}"
    others = {s for i, s in got.items() if i not in want_fail}
    assert others == {"PASS"}, f"the other tests must still pass: {others}"


def test_decode_ops_checks(teeth):
    """Decode ops: the reference ops pass; ops that skip RoPE fail exactly the qkv checks."""
    sel = ["-k", "test_decode_op and float32 and hd64"]
    ok = statuses(conformance.run("teeth-ok", pytest_args=sel))
    assert len(ok) == 5 * 3 and set(ok.values()) == {"PASS"}, ok  # qkv, linear, norm_linear, silu_linear,
    # norm_logits (14fdeca) x 1/5/8 tokens
    got = statuses(conformance.run("teeth-norope", pytest_args=sel))
    assert got.keys() == ok.keys()
    assert {i for i, s in got.items() if s == "FAIL"} == {i for i in got if "-qkv-" in i}
    assert {s for i, s in got.items() if "-qkv-" not in i} == {"PASS"}
    none = statuses(conformance.run("teeth-slot", pytest_args=sel))
    assert set(none.values()) == {"NOT_SUPPORTED"}


@pytest.mark.parametrize("name", ["teeth-causal", "teeth-halfcausal"])
def test_engine_level_catches_a_prefix_chunk_bug(teeth, name):
    """A chunk on a cached prefix masked wrongly: engine prefix-cache and chunked-prefill identity fail;
    one-shot prefill and decode (greedy parity, preemption by recompute) still pass. ``halfcausal`` is
    the same bug on a float16-only backend: tokens are scored by the float32 reference on the
    backend's own prefixes (teacher forcing), and the wrong mask still fails exactly those checks."""
    got = statuses(conformance.run(name, pytest_args=["-k", "test_engine and not pool"]))
    assert got == {
        "test_engine.py::test_greedy_matches_reference": "PASS",
        "test_engine.py::test_prefix_cache_identity": "FAIL",
        "test_engine.py::test_chunked_prefill_identity": "FAIL",
        "test_engine.py::test_preemption_identity": "PASS",
    }


def test_error_and_timeout_statuses(teeth):
    one = ["-k", "test_attention and float32 and bs16 and hd64 and decode and gqa4"]
    report = conformance.run("teeth-raises", pytest_args=one)
    (t,) = report["tests"]
    assert t["status"] == "ERROR" and "RuntimeError" in t["reason"] and "deliberate" in t["reason"]
    report = conformance.run("teeth-asserts", pytest_args=one)  # an assert in backend code is no FAIL
    (t,) = report["tests"]
    assert t["status"] == "ERROR" and "vendor-side assert" in t["reason"]
    report = conformance.run("teeth-hangs", pytest_args=[*one, "--test-timeout", "1"])
    (t,) = report["tests"]
    assert t["status"] == "TIMEOUT" and "1s" in t["reason"]
    assert report["summary"]["TIMEOUT"] == 1 and not report["all_pass_or_not_supported"]
    report = conformance.run("teeth-dodges", pytest_args=one)  # only Capabilities make NOT_SUPPORTED
    (t,) = report["tests"]
    assert t["status"] == "SKIPPED" and "deliberate" in t["reason"] and not report["all_pass_or_not_supported"]


def test_not_supported_comes_from_capabilities():
    """The toy backend declares block sizes 16..128 (multiples of 16), head sizes 64/128, no float16."""
    pytest.importorskip("hwkv_toy", reason="pip install -e examples/toy_backend")
    sel = "test_write_kv and scatter and hd64 and not (bs8 or bs32 or bs64 or bs128)"
    report = conformance.run("toy", pytest_args=["-k", sel])
    got = {t["id"]: (t["status"], t["reason"]) for t in report["tests"]}
    assert got["test_kv_write.py::test_write_kv[float32-bs16-hd64-scatter]"][0] == "PASS"
    status, reason = got["test_kv_write.py::test_write_kv[float32-bs1-hd64-scatter]"]
    assert status == "NOT_SUPPORTED" and "block_size 1 not supported (allowed: multiples of 16 up to 128)" in reason
    status, reason = got["test_kv_write.py::test_write_kv[float16-bs16-hd64-scatter]"]
    assert status == "NOT_SUPPORTED" and reason.startswith("dtype float16 not supported")


def test_certify_refuses_selection_and_overrides():
    with pytest.raises(ValueError, match="certify"):
        conformance.run("cpu", certify=True, pytest_args=["-k", "attention"])
    from hwkv.commands import conformance as cmd

    p = argparse.ArgumentParser()
    cmd.add_arguments(p)
    for extra in (["-k", "decode"], ["--tolerance-override", "float32:attention=1,1"], ["--", "-x"]):
        assert cmd.run(p.parse_args(["--backend", "cpu", "--certify", *extra])) == 2
    # and through plain pytest: the suite's own conftest refuses
    code = pytest.main([str(conformance.SUITE_DIR), "--backend", "cpu", "--certify", "-p", "no:cacheprovider",
                        "--tolerance-override", "float32:attention=1,1", "-q"])
    assert code == pytest.ExitCode.USAGE_ERROR


def test_unknown_backend_and_bad_override():
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        conformance.run("nope")
    with pytest.raises(ValueError, match="DTYPE:OP=ATOL,RTOL"):
        ToleranceTable(["float32-attention"])
    with pytest.raises(ValueError, match="unknown"):
        ToleranceTable(["float64:attention=1,1"])
    assert ToleranceTable(["float32:attention=0.1,0.2"]).get("float32", "attention").rtol == 0.2


def test_certified_only_when_every_test_passes_or_is_not_supported():
    def verdict(statuses: list[str], certify: bool = True) -> bool:
        plugin = ReportPlugin()
        plugin.configure({"certify": certify, "backend": "x"}, None, 1.0)
        for i, s in enumerate(statuses):
            plugin.results[str(i)] = {"id": str(i), "capability": "c", "status": s, "reason": "", "duration_s": 0.0}
        plugin.pytest_sessionfinish(None, 0)  # type: ignore[arg-type]
        assert "| " + str(len(statuses)) + " |" in markdown(plugin.report)
        return plugin.report["certified"]

    assert verdict(["PASS", "NOT_SUPPORTED"])
    assert not verdict(["PASS", "NOT_SUPPORTED"], certify=False)
    for bad in ("FAIL", "ERROR", "TIMEOUT", "SKIPPED"):
        assert not verdict(["PASS", bad]), bad
    assert not verdict([]), "an empty run certifies nothing"

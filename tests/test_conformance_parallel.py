"""conformance.parallel's claim groups: one kernel shape per group, long tests first, nothing lost."""

from __future__ import annotations

from types import SimpleNamespace

from conformance.parallel import claim_groups, claim_key


class Item:
    def __init__(self, nodeid: str, params: dict[str, object], timeout: float | None = None):
        self.nodeid, self.callspec, self.timeout = nodeid, SimpleNamespace(params=params), timeout

    def get_closest_marker(self, name: str):
        return SimpleNamespace(args=(self.timeout,)) if name == "timeout_s" and self.timeout else None


def test_groups_share_kernel_params_and_differ_in_scenario():
    items = [Item(f"t.py::test_attention[{d}-bs{b}-{s}-gqa{g}]", {"dtype": d, "block_size": b, "state": s, "gqa": g})
             for d in ("bf16", "f32") for b in (16, 32) for s in ("prefill", "decode") for g in ("1", "4")]
    groups = claim_groups(items)
    assert sorted(id(it) for g in groups for it in g) == sorted(id(it) for it in items)  # each item once
    assert len(groups) == 8
    for g in groups:
        assert len({claim_key(it) for it in g}) == 1
        assert [it.callspec.params["state"] for it in g] == ["prefill", "decode"]  # collection order kept
    assert [g[0].nodeid for g in groups[:2]] == [items[0].nodeid, items[1].nodeid]


def test_long_groups_first_and_functions_apart():
    short = [Item("a.py::test_write_kv[bf16-scatter]", {"dtype": "bf16", "pattern": "scatter"}),
             Item("a.py::test_write_kv[bf16-all]", {"dtype": "bf16", "pattern": "all"})]
    other = Item("a.py::test_other[bf16]", {"dtype": "bf16"})
    engine = Item("b.py::test_engine", {}, timeout=600)
    prod = Item("a.py::test_production[bf16]", {"dtype": "bf16"}, timeout=300)
    groups = claim_groups([*short, other, prod, engine])
    assert [[it.nodeid for it in g] for g in groups] == [
        [engine.nodeid], [prod.nodeid], [it.nodeid for it in short], [other.nodeid]]


def test_cli_devices_2_on_the_host(tmp_path):
    """``hwkv conformance --devices 2 --workers 2`` on the CPU (gloo ranks): the workers split over two
    devices, the collectives run on two ranks, and the merged report names the suite version, the
    devices, what ran on more than one device and the argument coverage."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "hwkv", "conformance", "--backend", "cpu", "--devices", "2", "--workers", "2",
           "-k", "test_collectives or test_keys_sizes_and_mixed_batches", "--report", str(tmp_path)]
    env = {**os.environ, "HWKV_CONFORMANCE_WORKDIR": str(tmp_path / "work")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "over 2 device(s)" in out.stdout and "multi-device: 1 / 1 passed" in out.stdout, out.stdout[-1000:]
    r = json.loads((tmp_path / "conformance.json").read_text())
    assert r["suite_version"] == __import__("conformance").SUITE_VERSION
    assert (r["devices"], r["workers"], r["quick"], r["certified"]) == (2, 2, False, False)
    assert r["worker_devices"] and r["device"] in r["worker_devices"]
    assert r["multi_device"] == {"devices": 2, "tests": [{"id": "test_multi_device.py::test_collectives",
                                                           "status": "PASS"}]}
    assert r["summary"] == {**r["summary"], "PASS": 2, "total": 2} and not r["parallel_problems"]
    cov = {(c["method"], c["arg"]) for c in r["coverage"]}
    assert {("Store.put", "keys"), ("Store.get", "keys"), ("Backend.create_store", "capacity_bytes")} <= cov, cov
    # the rank processes' calls merge in: the communicator contract, 1 element .. tens of MiB, and a capture
    ar = next(c for c in r["coverage"] if (c["method"], c["arg"]) == ("Communicator.all_reduce", "t"))
    assert {"bfloat16[1] contiguous", "bfloat16[8388608..16777215] contiguous"} <= set(ar["values"]), ar
    assert ar["distinct"] >= 3 * 5, ar  # every dtype at every size
    assert {("Communicator.all_gather", "dim"), ("Communicator.broadcast", "src"),
            ("Device.custom_all_reduce", "comm")} <= cov, cov
    # worker 0 (every device) runs the multi-device tests first, beside the other workers' groups
    first = (tmp_path / "work" / "times-0.txt").read_text().split("\n")[0]
    assert first.endswith("test_multi_device.py::test_collectives"), first
    md = (tmp_path / "conformance.md").read_text()
    assert "ran on more than one device" in md and "## Argument coverage" in md

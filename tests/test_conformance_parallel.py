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

"""The mutation harness (conformance/mutants): a fast subset in CI. The full score comes from
``python -m conformance.mutants`` (docs/conformance.md reports it): every mutant must fail ``--certify``.

Here: the registry's shape, the bug-free control passing the tests that kill the mutants (so a kill is
the bug's alone), and one mutant per interface — each a length- or batch-dependent bug that only the
suite-2.0 production-size cases see — killed by a certification run."""

from __future__ import annotations

from collections import Counter

import pytest

import conformance
from conformance.mutants import AREAS, control, controls, load, run_mutant
from hwkv.interfaces import Backend
from hwkv.testing.mooncake import skip_unless_mooncake

SUBSET = [
    "attn-partition-table-8",  # only a > 4096-token request shows it
    "attn-stale-block-table",  # only a second step with the batch reordered shows it
    "kv-chunk-tail-dropped",  # only a write of many 256-token chunks shows it
    "copy-pair-limit-64",  # only > 64 pairs show it
    "mem-static",  # only memory_info tracked across an allocation shows it
    "store-put-limit-32",  # only a put of more than 32 keys shows it
    "xfer-segment-limit-64",  # only > 64 segments in one call show it
    "graph-stale-inputs",  # only a replay after an in-place input change shows it (emulated graphs)
    "wait-event-orders-nothing",  # only a stream that is still running shows it (lazy streams)
    "kv-padded-rows-to-block-0",  # only a padded batch whose block 0 belongs to a real request shows it
    "allreduce-vector-tail",  # only sizes that are not a multiple of 8 elements show it (two gloo ranks)
    "ew-rope-host-positions",  # only a graph replay after the positions changed shows it (emulated graphs)
    "audit-chunked-copy",  # only > 128 pairs in one copy_blocks show it (suite 3.2)
    "audit-wait-stream-noop",  # only a read behind wait_stream of a running stream shows it (lazy streams)
    "audit-ascii-keys",  # only keys differing in one non-ASCII character show it
    "audit-publish-before-copy",  # only a get racing an overwrite of the same key shows it
]
CONTROL_SELECTION = ("(test_attention_production and (bs1 or bs16)) or (test_write_kv and production and bs16) "
                     "or (test_copy_blocks and float32) or test_transfer or test_store or test_memory_info")


def test_registry_has_forty_mutants_over_every_interface():
    mutants = load()
    assert len(mutants) >= 40, len(mutants)
    per_area = Counter(m.area for m in mutants.values())
    assert set(per_area) == set(AREAS) and min(per_area.values()) >= 5, per_area
    for m in mutants.values():
        assert m.bug and m.first, m
        b = m.build()
        assert isinstance(b, Backend) and b.name == f"mutant-{m.name}"


def test_control_passes_what_kills_the_mutants():
    skip_unless_mooncake()
    report = conformance.run(control(), pytest_args=["-k", CONTROL_SELECTION])
    got = {t["id"]: t["status"] for t in report["tests"]}
    assert len(got) >= 20 and set(got.values()) == {"PASS"}, {i: s for i, s in got.items() if s != "PASS"}


@pytest.mark.parametrize(("name", "selection"), [
    ("control-graphs", "test_graph_replay_reads_inputs_in_place or test_graph_captures_side_stream_fork_join"),
    ("control-lazy", "test_event_on_side_stream or test_stream_ordering_clauses or (test_copy_blocks and float32) "
                     "or test_host_staging"),
    ("control-collectives", "test_collectives"),
    ("control-collectives-graphs", "test_collectives"),
    ("control-host-copy", "test_host_staging"),
    ("control-elementwise-graphs", "test_elementwise"),
])
def test_runtime_controls_pass_what_kills_their_mutants(name, selection):
    """The emulated-graph, lazy-stream and custom-all-reduce devices without a bug pass the tests
    that kill their mutants: the kill is the bug's, not the emulation's."""
    report = conformance.run(controls()[name], pytest_args=["-k", selection])
    got = {t["id"]: t["status"] for t in report["tests"]}
    assert got and set(got.values()) == {"PASS"}, got


@pytest.mark.parametrize("name", SUBSET)
def test_mutant_fails_certification(name):
    if name.startswith("xfer-"):
        skip_unless_mooncake()
    r = run_mutant(load()[name])
    assert r["killed"], f"mutant {name} ({r['bug']}) was certified"
    assert "(FAIL" in r["by"] or "(ERROR" in r["by"], r["by"]


def test_a_stopped_run_is_never_certified_and_says_where():
    r = conformance.run(load()["kv-drops-last-token"].build(), certify=True,
                        run_first=["test_write_kv[float32-bs16-hd64-scatter]"], stop_at_first_failure=True)
    first = "test_kv_write.py::test_write_kv[float32-bs16-hd64-scatter]"
    assert not r["certified"] and r["stopped_early"] == f"{first}: FAIL"
    assert r["summary"]["total"] == 1

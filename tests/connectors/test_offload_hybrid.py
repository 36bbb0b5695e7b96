"""The CPU offload connector with a sliding-window model (every layer keeps the full context, so a
host-tier block serves every layer): tokens identical to the plain engine with and without load
failures, no block or pin leaked."""

from __future__ import annotations

import pytest

from .conftest import assert_no_leak, engine, run_one_by_one, workload
from .test_offload import MB, FailingLoads


@pytest.fixture(scope="module")
def windowed_reference(windowed_dir):
    return run_one_by_one(engine(windowed_dir), workload())


def test_windowed_model_offload_hits_match_the_plain_engine(windowed_dir, windowed_reference):
    e = engine(windowed_dir, kv_connector="offload", kv_connector_config={"cpu_bytes": MB})
    assert e.model.attention_features == ("sliding_window",)
    assert run_one_by_one(e, workload()) == windowed_reference
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 0 and st["external_hit_tokens"] > 0
    assert_no_leak(e)


def test_windowed_model_failed_load_is_recomputed(windowed_dir, windowed_reference):
    e = engine(windowed_dir, kv_connector=FailingLoads(cpu_bytes=MB))
    assert run_one_by_one(e, workload()) == windowed_reference
    assert e.stats()["kv_connector"]["load_failures"] == 1
    assert_no_leak(e)

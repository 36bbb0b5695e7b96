"""KV connectors under tensor parallelism (CPU, gloo, 2 worker processes): each rank's worker side
moves its own KV shard, the driver merges the ranks' outputs (a load is done once every rank did
it, failed if any rank failed it), tokens equal the tp=1 run's, and no block or pin is left."""

from __future__ import annotations

import pytest

from hwkv.core.sched_output import KVConnectorOutput
from hwkv.interfaces.connector import KVConnectorBase
from hwkv.parallel.kv_output import KVOutputAggregator
from tests.connectors.conftest import assert_no_leak, engine, run_one_by_one, workload
from tests.connectors.conftest import model_dir as model_dir  # noqa: F401 (fixture)

MB = 1 << 20


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: F811
    return run_one_by_one(engine(model_dir), workload())


def _no_leak(e) -> None:
    try:
        assert_no_leak(e)
        conn = e.scheduler.connector
        assert conn.cpu.num_free_blocks == conn.cpu.num_blocks and not conn._jobs
        assert e.runner.kv_outputs.pending() == 0  # every rank's report of every job arrived
    finally:
        e.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cfg", [{}, {"async_load": True}], ids=["sync-load", "async-load"])
def test_offload_at_tp2_loads_every_shard(model_dir, reference, cfg):  # noqa: F811
    e = engine(model_dir, tensor_parallel_size=2, kv_connector="offload",
               kv_connector_config={"cpu_bytes": MB, **cfg})
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 0 and st["external_hit_tokens"] == 2 * 4 * 16
    # bytes of both ranks' shards: each holds half the KV heads of the 8 loaded blocks
    assert st["loaded_bytes"] == 8 * e.kv_cache.spec.bytes_per_block * 2
    _no_leak(e)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fail_rank, cfg", [(1, {}), (0, {}), (1, {"async_load": True})],
                         ids=["worker-sync", "driver-sync", "worker-async"])
def test_one_rank_failing_a_load_recomputes(model_dir, reference, fail_rank, cfg):  # noqa: F811
    e = engine(model_dir, tensor_parallel_size=2, kv_connector="hwkv.testing.tp_connectors:FailingRank",
               kv_connector_config={"cpu_bytes": MB, "fail_rank": fail_rank, **cfg})
    assert run_one_by_one(e, workload()) == reference  # the other rank's good shard is not enough
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 1 and st["failed_loads"] == 1
    assert st["external_hit_tokens"] == 4 * 16  # only the second load (the third prompt) counted
    _no_leak(e)


def test_connectors_that_cannot_run_tensor_parallel_are_refused(model_dir):  # noqa: F811
    from hwkv.connectors.offload import OffloadConnector

    with pytest.raises(ValueError, match="kv_connector must be given by name"):
        engine(model_dir, tensor_parallel_size=2, kv_connector=OffloadConnector(cpu_bytes=MB))
    with pytest.raises(ValueError, match=r"kv_connector 'noop-ish' does not run tensor-parallel \(allowed: "):
        engine(model_dir, tensor_parallel_size=2, kv_connector="tests.parallel.test_tp_connectors:NotTP")


class NotTP(KVConnectorBase):
    name = "noop-ish"


class _Conn(KVConnectorBase):
    tp_job_keys = ("jobs",)

    def merge_tp_extra(self, key, values):
        return tuple(values)


def _out(**kw) -> KVConnectorOutput:
    return KVConnectorOutput(**{k: set(v) if k != "extra" else v for k, v in kw.items()})


def test_aggregation_rules():
    agg = KVOutputAggregator(2, _Conn())
    # an async load: done only once both ranks reported it; failed if either failed
    assert agg.aggregate([(0, _out(finished_recving={"a", "b"}))], ()) is None
    out = agg.aggregate([(1, _out(finished_recving={"a"}, failed_recving={"b"}))], ())
    assert out.finished_recving == {"a"} and out.failed_recving == {"b"}
    # a synchronous load (its request ran this step) failed on one rank: failed at once
    out = agg.aggregate([(0, None), (1, _out(failed_recving={"c"}))], {"c"})
    assert out.failed_recving == {"c"} and not out.finished_recving
    # sends: both ranks
    assert agg.aggregate([(1, _out(finished_sending={"s"}))], ()) is None
    assert agg.aggregate([(0, _out(finished_sending={"s"}))], ()).finished_sending == {"s"}
    # jobs: complete once both reported, ok only if both were, details summed; other keys merged
    assert agg.aggregate([(0, _out(extra={"jobs": [(7, True, 10)]}))], ()) is None
    out = agg.aggregate([(1, _out(extra={"jobs": [(7, False, 12)], "epoch": 3}))], ())
    assert out.extra == {"jobs": [(7, False, 22)], "epoch": (None, 3)}
    assert agg.pending() == 0

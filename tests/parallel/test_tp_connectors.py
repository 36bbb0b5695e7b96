"""KV connectors under tensor parallelism (CPU, gloo, 2 worker processes): each rank's worker side
moves its own KV shard, the driver merges the ranks' outputs (a load is done once every rank did
it, failed if any rank failed it), tokens equal the tp=1 run's, and no block or pin is left."""

from __future__ import annotations

import pytest
import torch

from hwkv.core.sched_output import KVConnectorOutput
from hwkv.engine.model_runner import ModelRunner
from hwkv.engine.tp.kv_output import KVOutputAggregator
from hwkv.interfaces.connector import KVConnectorBase
from tests.connectors.conftest import assert_no_leak, engine, greedy, run_one_by_one, workload
from tests.connectors.conftest import model_dir as model_dir  # noqa: F401 (fixture)

MB = 1 << 20


@pytest.fixture(scope="module")
def reference(model_dir):  # noqa: F811
    return run_one_by_one(engine(model_dir), workload())


@pytest.fixture
def tp_engine(model_dir):  # noqa: F811
    """Builds the test's tp=2 engine and closes it however the test ends (one tensor-parallel engine
    per process at a time: a worker left behind would break the next test)."""
    made = []

    def build(**kw):
        made.append(engine(model_dir, tensor_parallel_size=2, **kw))
        return made[-1]

    yield build
    for e in made:
        e.close()


def _no_leak(e) -> None:
    assert_no_leak(e)
    conn = e.scheduler.connector.scheduler
    assert conn.cpu.num_free_blocks == conn.cpu.num_blocks and not conn._jobs
    assert e.runner.kv_outputs.pending() == 0  # every rank's report of every job arrived


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cfg", [{}, {"async_load": True}], ids=["sync-load", "async-load"])
def test_offload_at_tp2_loads_every_shard(tp_engine, reference, cfg):
    e = tp_engine(kv_connector="offload", kv_connector_config={"cpu_bytes": MB, **cfg})
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 0 and st["external_hit_tokens"] == 2 * 4 * 16
    # bytes of both ranks' shards: each holds half the KV heads of the 8 loaded blocks
    assert st["loaded_bytes"] == 8 * e.kv_cache.spec.bytes_per_block * 2
    _no_leak(e)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fail_rank, cfg", [(1, {}), (0, {}), (1, {"async_load": True})],
                         ids=["worker-sync", "driver-sync", "worker-async"])
def test_one_rank_failing_a_load_recomputes(tp_engine, reference, fail_rank, cfg):
    e = tp_engine(kv_connector="hwkv.testing.tp_connectors:FailingRank",
                  kv_connector_config={"cpu_bytes": MB, "fail_rank": fail_rank, **cfg})
    assert run_one_by_one(e, workload()) == reference  # the other rank's good shard is not enough
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 1 and st["failed_loads"] == 1
    assert st["external_hit_tokens"] == 4 * 16  # only the second load (the third prompt) counted
    _no_leak(e)


@pytest.mark.timeout(240)
def test_a_step_failing_in_the_drivers_update_states_leaks_no_pin_on_any_rank(tp_engine, reference, monkeypatch):
    """The driver's update_states raises on the step carrying a load: the workers get the step
    without a forward, every rank binds its metadata unissued and retires it next step (pins
    released everywhere, every rank reported), and the request recomputes to the same tokens."""
    e = tp_engine(kv_connector="offload", kv_connector_config={"cpu_bytes": MB})
    prompts = workload()
    assert run_one_by_one(e, prompts[:1]) == reference[:1]
    orig, failed = ModelRunner.update_states, []

    def failing(self, so):  # the driver's own state update (the workers are other processes)
        meta = so.kv_connector_metadata
        if meta is not None and meta.loads and not failed:
            failed.append(so)
            raise RuntimeError("injected update_states failure")
        return orig(self, so)

    monkeypatch.setattr(ModelRunner, "update_states", failing)
    got = []
    for p in prompts[1:4]:
        e.add_request(f"r{len(got)}", p, greedy())
        for _ in range(200):
            if not e.has_unfinished():
                break
            try:
                got += [(o.token_ids, o.finish_reason) for o in e.step() if o.finished]
            except RuntimeError as ex:
                assert "injected" in str(ex)
    assert failed, "no step carried a load"
    assert got == [(t, "length") for t in reference[1:4]]
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
    return KVConnectorOutput(**{k: set(v) if k not in ("extra", "valid_tokens") else v for k, v in kw.items()})


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
    # a failed load's valid tokens: the smallest over the ranks that failed it (one saying none: none)
    assert agg.aggregate([(0, _out(failed_recving={"v"}, valid_tokens={"v": 48}))], ()) is None
    out = agg.aggregate([(1, _out(failed_recving={"v"}, valid_tokens={"v": 32}))], ())
    assert out.failed_recving == {"v"} and out.valid_tokens == {"v": 32}
    out = agg.aggregate([(0, _out(failed_recving={"w"}, valid_tokens={"w": 16})), (1, _out(failed_recving={"w"}))],
                        {"w"})
    assert out.failed_recving == {"w"} and out.valid_tokens == {}
    assert agg.pending() == 0 and not agg._valid


# ---- pool -----------------------------------------------------------------------------------------
POOL_PROMPT = [(5 * i + 1) % 500 + 1 for i in range(150)]  # 9 full blocks before the last token
POOL_CHILD = r"""
import json, sys, time
import torch
import hwkv
from hwkv import SamplingParams
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
model, prompt, tp = cfg.pop("model"), cfg.pop("prompt"), cfg.pop("tp")
e = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=16, kv_connector="pool",
                kv_connector_config=cfg, tensor_parallel_size=tp)
toks = e.generate([prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids
conn, deadline = e.scheduler.connector, time.monotonic() + 30
while conn.has_pending_transfers() and time.monotonic() < deadline:
    e.step()
    time.sleep(0.01)
st = e.stats()["kv_connector"]
print(json.dumps({"tokens": toks, "free": e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks,
                  "stats": {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool))}}), flush=True)
sys.stdin.readline()  # its segments hold pool values: stay until told to go
e.close()
conn.shutdown()
"""


def _pool_cfg(m) -> dict:
    return dict(store="mooncake", master=m.master, metadata_server=m.metadata_server, protocol="tcp",
                global_segment_size=16 << 20, local_buffer_size=16 << 20)


def _settled_pool(e, timeout_s: float = 30.0) -> dict:
    import time

    conn, deadline = e.scheduler.connector, time.monotonic() + timeout_s
    while conn.has_pending_transfers():
        assert time.monotonic() < deadline, "pool transfers did not complete"
        e.step()
        time.sleep(0.01)
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks and not e.runner.reqs
    assert getattr(e.runner, "kv_outputs", None) is None or e.runner.kv_outputs.pending() == 0
    return e.stats()["kv_connector"]


@pytest.mark.timeout(300)
def test_pool_shards_are_shared_by_equal_splits_only(tmp_path):
    """A tp=2 engine (its own process, staying up: its segments hold the values) fills the pool;
    another tp=2 engine loads every shard of the prefix from it (identical tokens); a tp=1 engine
    never hits the tp=2 shards."""
    import json
    import os
    import subprocess
    import sys

    from hwkv import Engine, SamplingParams
    from hwkv.model.tiny import write_tiny_model
    from hwkv.stores.mooncake_service import mooncake_master
    from hwkv.testing.mooncake import skip_unless_mooncake

    skip_unless_mooncake()
    model = str(write_tiny_model(tmp_path / "m", num_heads=4, num_kv_heads=2, tokenizer=False))
    sp = SamplingParams(max_tokens=6, temperature=0)
    kw = dict(num_kv_blocks=64, max_model_len=256, block_size=16)
    want = Engine(model, **kw).generate([POOL_PROMPT], sp, use_tqdm=False)[0].token_ids
    with mooncake_master() as m:
        cfg = {"model": model, "prompt": POOL_PROMPT, "tp": 2, **_pool_cfg(m)}
        a = subprocess.Popen([sys.executable, "-c", POOL_CHILD, json.dumps(cfg)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            line = a.stdout.readline()  # bounded by the test's timeout; a dead child gives ""
            assert line, "the tp=2 filling engine failed"
            ra = json.loads(line)
            assert ra["tokens"] == want and ra["free"]
            assert ra["stats"]["stored_chunks"] == 9 and ra["stats"]["external_hit_tokens"] == 0
            c = Engine(model, kv_connector="pool", kv_connector_config=_pool_cfg(m), **kw)  # tp=1
            try:
                assert c.generate([POOL_PROMPT], sp, use_tqdm=False)[0].token_ids == want
                st = _settled_pool(c)
                assert st["external_hit_tokens"] == 0 and st["stored_chunks"] == 9  # its own shard layout
            finally:
                c.close()
                c.scheduler.connector.shutdown()
            b = Engine(model, tensor_parallel_size=2, kv_connector="pool", kv_connector_config=_pool_cfg(m), **kw)
            try:
                assert b.generate([POOL_PROMPT], sp, use_tqdm=False)[0].token_ids == want
                st = _settled_pool(b)
                assert st["external_hit_tokens"] == 9 * 16 and st["load_failures"] == 0
                assert st["loaded_bytes"] == ra["stats"]["stored_bytes"] > 0  # both shards
                assert st["stored_bytes"] == 0  # the prefix it loaded is not put again
            finally:
                b.close()
                b.scheduler.connector.shutdown()
        finally:
            if a.poll() is None:
                a.stdin.write("\n")
                a.stdin.flush()
                try:
                    a.wait(30)
                except subprocess.TimeoutExpired:
                    a.kill()
                    a.wait()
            a.stdin.close()
            a.stdout.close()
        assert a.returncode == 0


def test_pool_lookup_counts_a_chunk_only_where_every_shard_is(tmp_path):
    from hwkv.connectors.pool import PoolConnector
    from hwkv.connectors.pool.key import PoolKey
    from hwkv.connectors.pool.store import drop_embedded, embedded_store

    conn = PoolConnector(store="embedded", store_name="tp-lookup")
    try:
        conn.bind_tp(0, 2)
        conn.worker.key = PoolKey("m-0", "nhd", "float32", 2, 1, 16, 16, 1, 0, 2)
        store = embedded_store("tp-lookup")
        hashes = [bytes([i]) * 8 for i in range(3)]
        buf = torch.zeros(4)
        ptr = [(buf.data_ptr(), 16)]

        def put(rank, hs):
            store.put(PoolKey("m-0", "nhd", "float32", 2, 1, 16, 16, 1, rank, 2).keys(hs), [ptr] * len(hs))

        put(0, hashes)
        assert conn.worker._count_hits(hashes) == 0  # rank 1's shard is missing everywhere
        put(1, hashes[:2])
        assert conn.worker._count_hits(hashes) == 2
    finally:
        conn.shutdown()
        drop_embedded("tp-lookup")


def test_pool_presence_per_group_counts_a_chunk_only_where_every_shard_is():
    """KV-cache groups at tp=2: the lookup's presence flags, group-major, need the group's key of
    every rank (a group's chunks never stand in for another's)."""
    from dataclasses import replace

    from hwkv.connectors.pool import PoolConnector
    from hwkv.connectors.pool.key import PoolKey
    from hwkv.connectors.pool.store import drop_embedded, embedded_store

    conn = PoolConnector(store="embedded", store_name="tp-presence")
    try:
        conn.bind_tp(0, 2)
        base = PoolKey("m-0", "nhd", "float32", 1, 1, 16, 16, 1, 0, 2)
        conn.worker.keys = [replace(base, group="g0-full"), replace(base, num_layers=2, group="g1-w16")]
        store = embedded_store("tp-presence")
        hashes = [bytes([i]) * 8 for i in range(3)]
        buf = torch.zeros(4)
        ptr = [(buf.data_ptr(), 16)]

        def put(g, rank, hs):
            store.put(replace(conn.worker.keys[g], tp_rank=rank).keys(hs), [ptr] * len(hs))

        put(0, 0, hashes)
        put(0, 1, hashes[:2])
        put(1, 0, hashes[1:])
        assert conn.worker._presence(hashes) == [True, True, False, False, False, False]
        put(1, 1, hashes[2:])
        assert conn.worker._presence(hashes) == [True, True, False, False, False, True]
    finally:
        conn.shutdown()
        drop_embedded("tp-presence")


@pytest.mark.timeout(240)
def test_pool_with_kv_cache_groups_at_tp2(tmp_path):
    """A Qwen2 windowed from layer 1 (a full and a window-16 group) at tp=2 through the pool on a real
    mooncake_master, without a device prefix cache (every repeat asks the pool): each rank puts and
    gets its shard of each group's chunks; the repeat loads the full group's 9 chunks and the window
    group's last one, tokens equal the tp=1 run's, nothing held on any rank."""
    import json

    from hwkv import Engine, SamplingParams
    from hwkv.model.tiny import write_tiny_model
    from hwkv.stores.mooncake_service import mooncake_master
    from hwkv.testing.mooncake import skip_unless_mooncake

    skip_unless_mooncake()
    path = write_tiny_model(tmp_path / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2, tokenizer=False,
                            sliding_window=16, max_position_embeddings=512)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "max_window_layers": 1}))
    sp = SamplingParams(max_tokens=6, temperature=0)
    kw = dict(num_kv_blocks=64, max_model_len=256, block_size=16, enable_prefix_caching=False)
    want = Engine(str(path), **kw).generate([POOL_PROMPT], sp, use_tqdm=False)[0].token_ids
    with mooncake_master() as m:
        e = Engine(str(path), tensor_parallel_size=2, kv_connector="pool", kv_connector_config=_pool_cfg(m), **kw)
        try:
            assert [g.window for g in e.config.kv_groups] == [None, 16]
            assert e.generate([POOL_PROMPT], sp, use_tqdm=False)[0].token_ids == want
            st = _settled_pool(e)
            assert st["stored_chunks"] == 18 and st["external_hit_tokens"] == 0  # 9 chunks of each group
            assert e.generate([POOL_PROMPT], sp, use_tqdm=False)[0].token_ids == want
            st2 = _settled_pool(e)
            assert st2["external_hit_tokens"] == 9 * 16 and st2["load_failures"] == 0
            # each group's chunk is one layer of both shards: 9 full-group chunks + the window group's last
            assert st2["loaded_bytes"] == 10 * st["stored_bytes"] // 18
            for mgr in e.kv_cache_manager.managers:
                assert mgr.block_pool.num_free_blocks == mgr.block_pool.num_usable_blocks
        finally:
            e.close()
            e.scheduler.connector.shutdown()


@pytest.mark.timeout(240)
def test_offload_with_kv_cache_groups_at_tp2(tmp_path):
    """A windowed Mistral (one window group) through offload at tp=2: every rank's worker side moves
    its shard of the group's blocks under the flat ids; tokens equal the tp=1 run's, nothing leaked."""
    from hwkv.model.tiny import write_tiny_model

    path = str(write_tiny_model(tmp_path / "mistral", arch="mistral", sliding_window=16, max_position_embeddings=512))
    want = run_one_by_one(engine(path), workload())
    e = engine(path, tensor_parallel_size=2, kv_connector="offload", kv_connector_config={"cpu_bytes": MB})
    try:
        assert [g.window for g in e.config.kv_groups] == [16]
        assert run_one_by_one(e, workload()) == want
        st = e.stats()["kv_connector"]
        assert st["load_failures"] == 0 and st["external_hit_tokens"] > 0
        _no_leak(e)
    finally:
        e.close()

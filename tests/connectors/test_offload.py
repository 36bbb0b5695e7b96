"""CPU offload connector through the engine: host-tier hits give the tokens a run without the
connector gives, loads that fail are recomputed, and no pin or block outlives its transfer."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.connectors.offload import OffloadConnector
from hwkv.connectors.offload.worker import OffloadWorker
from hwkv.reference.backend import CpuBackend
from hwkv.reference.device import CpuDevice, CpuEvent

from .conftest import assert_no_leak, engine, greedy, run_one_by_one, settle, workload

MB = 1 << 20


@pytest.fixture(scope="module")
def reference(model_dir):
    e = engine(model_dir)
    want = run_one_by_one(e, workload())
    assert e.stats()["prefix_cache_hits"] == 0  # the pool really is too small to keep the prefix
    return want


@pytest.mark.parametrize("kw, cfg", [
    ({}, {}),
    ({"async_scheduling": True}, {}),
    ({}, {"async_load": True}),
    ({"async_scheduling": True}, {"async_load": True}),
    ({"max_num_batched_tokens": 32}, {}),  # the loaded request continues in chunks
    ({"enable_prefix_caching": False}, {}),
], ids=["sync", "async-sched", "async-load", "async-both", "chunked", "no-prefix-cache"])
def test_evicted_prefix_comes_back_from_the_host_tier(model_dir, reference, kw, cfg):
    e = engine(model_dir, kv_connector="offload", kv_connector_config={"cpu_bytes": MB, **cfg}, **kw)
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert st["name"] == "offload" and st["load_failures"] == 0
    assert st["external_hit_tokens"] == 2 * 4 * 16  # the 2nd and 3rd prefix users load 4 blocks each
    assert st["loaded_bytes"] == 8 * e.kv_cache.spec.bytes_per_block and st["stored_bytes"] > 0
    assert_no_leak(e)


class FailingLoadsWorker(OffloadWorker):
    fails = 1

    def load_blocks(self, host_ids, device_ids, layer=None):
        if self.fails:
            self.fails -= 1
            raise RuntimeError("injected load failure")
        super().load_blocks(host_ids, device_ids, layer)


class FailingLoads(OffloadConnector):
    """Host-tier loads fail to issue ``fails`` times (a transfer error), then work."""

    worker_cls = FailingLoadsWorker

    def __init__(self, fails: int = 1, **kw):
        super().__init__(**kw)
        self.worker.fails = fails


@pytest.mark.parametrize("kw, cfg", [
    ({}, {}), ({"async_scheduling": True}, {}), ({}, {"async_load": True}),
], ids=["sync", "async-sched", "async-load"])
def test_failed_load_is_recomputed_with_identical_tokens(model_dir, reference, kw, cfg):
    conn = FailingLoads(cpu_bytes=MB, **cfg)
    e = engine(model_dir, kv_connector=conn, **kw)
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 1
    assert st["external_hit_tokens"] == 4 * 16  # only the second load (the third prompt) counted
    assert_no_leak(e)


def test_failed_sync_load_discards_the_token_computed_on_it(model_dir):
    """Regression: the step of a failed synchronous load samples on KV that never arrived; that
    token must not reach the output (it used to be kept)."""
    e = engine(model_dir, kv_connector=FailingLoads(cpu_bytes=MB))
    p = workload()
    run_one_by_one(e, p[:3])  # stores the prefix, evicts it from the device
    e.add_request("x", p[3], greedy())
    seen: list[list[int]] = []
    while e.has_unfinished():
        seen += [o.token_ids for o in e.step() if o.request_id == "x"]
    want = run_one_by_one(engine(model_dir), [p[3]])[0]
    assert seen[-1] == want and all(want[: len(t)] == t for t in seen)  # no wrong token ever streamed
    assert e.stats()["kv_connector"]["load_failures"] == 1 and e.scheduler.num_preemptions == 0
    assert_no_leak(e)


class GatedEvent(CpuEvent):
    def __init__(self, gate: list[bool], *a, **kw):
        super().__init__(*a, **kw)
        self.gate = gate

    def query(self) -> bool:
        return self.gate[0]


class GatedDevice(CpuDevice):
    """Copies happen at once, but their events report completion only while ``gate[0]``: a transfer
    that is still in flight, as on a device."""

    def __init__(self):
        super().__init__()
        self.gate = [True]

    def new_event(self, enable_timing: bool = False):
        return GatedEvent(self.gate, enable_timing)


def gated_engine(model_dir: str, conn, **kw):
    backend = CpuBackend()
    backend._device = GatedDevice()
    return engine(model_dir, backend=backend, kv_connector=conn, **kw), backend._device.gate


def test_abort_mid_load_leaks_no_pin(model_dir):
    conn = OffloadConnector(cpu_bytes=MB, async_load=True)
    e, gate = gated_engine(model_dir, conn)
    p = workload()
    run_one_by_one(e, p[:3])
    settle(e)  # the last request's blocks are stored on the step after it finished
    gate[0] = False
    e.add_request("x", p[3], greedy())
    e.step()
    req = e.scheduler.requests["x-" + e._live["x"].split("-")[-1]]
    assert req.status.name == "WAITING_FOR_REMOTE_KVS"
    (job,) = [j for j in conn.scheduler._jobs.values() if j.load]
    assert all(b.ref_cnt == 2 for b in job.device) and all(b.ref_cnt == 1 for b in job.host)
    e.abort("x")
    outs = e.step()
    assert [o.finish_reason for o in outs if o.request_id == "x"] == ["abort"]
    assert all(b.ref_cnt == 1 for b in job.device)  # the request let go; the copy still writes them
    assert e.kv_cache_manager.num_free_blocks < e.kv_cache.spec.num_blocks
    gate[0] = True
    assert_no_leak(e)


def test_preempt_mid_load_leaks_no_pin_and_recomputes(model_dir, reference):
    """A request whose load is still in flight is preempted (the pool runs out as another request
    decodes); its loaded blocks stay pinned until the copy ends, and it restarts (from the host
    tier again) with the reference tokens."""
    import random

    conn = OffloadConnector(cpu_bytes=MB)
    e, gate = gated_engine(model_dir, conn)
    p = workload()
    assert run_one_by_one(e, p[:3]) == reference[:3]
    settle(e)
    a = [random.Random(5).randrange(1, 500) for _ in range(47)]  # 3 blocks; its 2nd decode needs a 4th
    want_a = run_one_by_one(engine(model_dir), [a], n=10)[0]
    gate[0] = False
    e.add_request("a", a, greedy(10))
    e.step()
    e.add_request("low", p[3], greedy())
    e.step()  # low: admitted with a load from the host tier whose completion has not fired; 8/8 blocks used
    (job,) = [j for j in conn.scheduler._jobs.values() if j.load]
    outs = e.step()  # a needs a block: low, the newest, is preempted
    assert e.scheduler.num_preemptions == 1
    assert all(b.ref_cnt == 1 for b in job.device)  # held by the copy alone, not handed to a
    gate[0] = True
    while e.has_unfinished():
        outs += e.step()
    final = {o.request_id: o.token_ids for o in outs if o.finished}
    assert final == {"a": want_a, "low": reference[3]}
    # once confirmed, the loaded blocks joined the device prefix cache: low's restart hits them there
    assert e.stats()["kv_connector"]["external_hit_tokens"] == 4 * 16
    assert_no_leak(e)


def test_store_only_full_blocks_and_dedup(model_dir):
    e = engine(model_dir, num_kv_blocks=16, kv_connector="offload", kv_connector_config={"cpu_bytes": MB})
    prompt = workload()[1]
    e.generate([prompt, prompt], greedy(), use_tqdm=False)
    settle(e)  # finished requests' last blocks are stored on the next step
    conn = e.scheduler.connector
    full = (len(prompt) + 6 - 1) // 16  # KV is written for all but the last sampled token
    assert len(conn.scheduler.cpu.cached_block_hash_to_block) == full  # the second copy stored nothing new
    assert e.stats()["kv_connector"]["stored_bytes"] == full * e.kv_cache.spec.bytes_per_block
    assert_no_leak(e)


def test_bad_config_is_refused_before_the_model_loads(model_dir, tmp_path):
    missing = str(tmp_path / "no-model")
    with pytest.raises(ValueError, match="cpu_bytes must be a positive int"):
        hwkv.Engine(missing, kv_connector="offload", kv_connector_config={"cpu_bytes": 0})
    with pytest.raises(ValueError, match="unknown config key.*cpu_byte.*allowed: async_load, cpu_bytes"):
        hwkv.Engine(missing, kv_connector="offload", kv_connector_config={"cpu_byte": 1})
    with pytest.raises(ValueError, match="holds no KV block"):
        engine(model_dir, kv_connector="offload", kv_connector_config={"cpu_bytes": 10})


def test_async_load_that_times_out_is_recomputed_and_keeps_its_pins(model_dir, reference):
    """An asynchronous load still running after load_timeout_s is reported failed: the request
    recomputes (reference tokens) while the copy, still in flight, keeps its blocks pinned."""
    conn = OffloadConnector(cpu_bytes=MB, async_load=True, load_timeout_s=0.001)
    e, gate = gated_engine(model_dir, conn, num_kv_blocks=16)  # room to recompute beside the pinned blocks
    p = workload()
    run_one_by_one(e, p[:3])
    settle(e)
    assert e.kv_cache_manager.reset_prefix_cache()  # the prefix is in the host tier only
    gate[0] = False
    e.add_request("x", p[3], greedy())
    outs = []
    for _ in range(200):  # the copy never completes while the gate is closed
        outs += e.step()
        if any(o.finished for o in outs):
            break
    assert [o.token_ids for o in outs if o.finished] == [reference[3]]
    (job,) = [j for j in conn.scheduler._jobs.values() if j.load]
    assert all(b.ref_cnt == 1 for b in job.device + job.host)  # the copy's pins alone
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 1 and st["external_hit_tokens"] == 0
    gate[0] = True
    assert_no_leak(e)

"""Offload connector and preemption: a preempted request's full blocks are stored before its device
blocks can be reused, so its re-admission loads the prefix from the host tier; the tokens are those
of a run without the connector, and no pin or block outlives the transfers."""

from __future__ import annotations

import random

import pytest

import hwkv
from hwkv.connectors.offload import OffloadConnector
from hwkv.connectors.offload.worker import OffloadWorker
from hwkv.reference.backend import CpuBackend
from hwkv.reference.device import CpuDevice, CpuEvent

from .conftest import assert_no_leak, engine, greedy

MB = 1 << 20
rng = random.Random(3)
A = [rng.randrange(1, 500) for _ in range(47)]  # 3 blocks, decoding to 127 tokens: 8 blocks
B = [rng.randrange(1, 500) for _ in range(70)]  # 4 full blocks + 1


def drain(e: hwkv.Engine, limit: int = 400) -> list:
    """Step until nothing is left (bounded: a stuck engine fails the test instead of hanging it)."""
    outs = []
    for _ in range(limit):
        if not e.has_unfinished():
            return outs
        outs += e.step()
    raise AssertionError(f"engine still busy after {limit} steps")


def run_a_then_b(e: hwkv.Engine) -> dict[str, list[int]]:
    """A runs, B joins (8/8 blocks), A's next block preempts B (the newest); A then grows over all of
    B's blocks, and B comes back only once A finished."""
    e.add_request("a", A, greedy(80))
    e.step()
    e.add_request("b", B, greedy(10))
    return {o.request_id: o.token_ids for o in drain(e) if o.finished}


@pytest.fixture(scope="module")
def reference(model_dir):
    e = engine(model_dir)
    want = run_a_then_b(e)
    assert e.scheduler.num_preemptions == 1 and e.stats()["prefix_cache_hits"] == 0  # B recomputed all
    return want


@pytest.mark.parametrize("kw, cfg, full", [
    ({}, {}, 4),
    ({"async_scheduling": True}, {}, 4),
    ({}, {"async_load": True}, 4),
    ({"max_num_batched_tokens": 32}, {}, 3),  # B is preempted mid-prefill, 48 tokens computed
    ({"enable_prefix_caching": False}, {}, 4),
], ids=["sync", "async-sched", "async-load", "chunked", "no-prefix-cache"])
def test_preempted_prefix_comes_back_from_the_host_tier(model_dir, reference, kw, cfg, full):
    e = engine(model_dir, kv_connector="offload", kv_connector_config={"cpu_bytes": MB, **cfg}, **kw)
    free0, conn = e.kv_cache_manager.num_free_blocks, e.scheduler.connector
    assert run_a_then_b(e) == reference
    st = e.stats()["kv_connector"]
    assert e.scheduler.num_preemptions == 1
    # B's full blocks (store_batch_blocks never reached) were stored when it was preempted ...
    assert st["preempted_store_blocks"] == full and st["stores_skipped_full"] == 0
    # ... and all came back from the host tier (A's growth evicted them from the device)
    assert st["external_hit_tokens"] == full * 16 and st["load_failures"] == 0
    assert_no_leak(e)
    cpu = conn.scheduler.cpu
    assert e.kv_cache_manager.num_free_blocks == free0 and cpu.num_free_blocks == cpu.num_blocks


def test_priority_displacement_stores_the_displaced_request(model_dir):
    """Phase-2 preemption (a higher-priority arrival displaces a running request) stores too."""
    kw = {"scheduling_policy": "priority"}
    outs = {}
    for conn in (None, "offload"):
        e = engine(model_dir, kv_connector=conn, kv_connector_config={"cpu_bytes": MB} if conn else None, **kw)
        e.add_request("b", B, greedy(4), priority=1)
        e.step()
        e.step()
        e.add_request("a", A + A[:60], greedy(20), priority=0)  # 7 blocks + decode: B must go
        got = drain(e)
        assert e.scheduler.num_preemptions == 1
        outs[conn] = {o.request_id: o.token_ids for o in got if o.finished}
        if conn:
            st = e.stats()["kv_connector"]
            assert st["preempted_store_blocks"] == 4 and st["external_hit_tokens"] > 0
            assert_no_leak(e)
    assert outs["offload"] == outs[None]


class HeldEvent(CpuEvent):
    def __init__(self, dev: HoldingDevice, *a, **kw):
        super().__init__(*a, **kw)
        self.dev, self.held = dev, dev.capturing

    def query(self) -> bool:
        return not self.held or self.dev.released


class HoldingDevice(CpuDevice):
    """Copies happen at once, but the events created while ``capturing`` report completion only once
    ``released``: those transfers are still in flight, as on a device."""

    def __init__(self):
        super().__init__()
        self.capturing = self.released = False

    def new_event(self, enable_timing: bool = False):
        return HeldEvent(self, enable_timing)


def test_store_still_in_flight_at_readmission_recomputes_and_leaks_nothing(model_dir, reference):
    """On a device the preemption's store may not have completed when the request is looked up
    again: the tier offers no bytes in flight (B recomputes), and the pins end with the copy."""
    conn, backend = OffloadConnector(cpu_bytes=MB), CpuBackend()
    backend._device = dev = HoldingDevice()
    e = engine(model_dir, backend=backend, kv_connector=conn)
    e.add_request("a", A, greedy(80))
    e.step()
    e.add_request("b", B, greedy(10))
    dev.capturing, outs = True, []
    for _ in range(100):
        if e.scheduler.num_preemptions:
            break
        outs += e.step()
    dev.capturing = False
    (job,) = [j for j in conn.scheduler._jobs.values() if not j.load]  # B's store, in flight
    assert job.device == [] and len(job.host) == 4  # it pins no device block: B freed all 5 at once
    assert all(b.ref_cnt == 1 for b in job.host) and not conn.scheduler.cpu.cached_block_hash_to_block
    for _ in range(400):
        if {o.request_id for o in outs if o.finished} == {"a", "b"}:
            break
        outs += e.step()
    assert {o.request_id: o.token_ids for o in outs if o.finished} == reference
    assert e.stats()["kv_connector"]["external_hit_tokens"] == 0 and job.job_id in conn.scheduler._jobs
    dev.released = True
    assert_no_leak(e)


class FailingStoresWorker(OffloadWorker):
    def store_blocks(self, device_ids, host_ids):
        raise RuntimeError("injected store failure")


class FailingStores(OffloadConnector):
    worker_cls = FailingStoresWorker


def test_failed_preemption_store_registers_nothing(model_dir, reference):
    e = engine(model_dir, kv_connector=FailingStores(cpu_bytes=MB))
    assert run_a_then_b(e) == reference
    st = e.stats()["kv_connector"]
    assert st["preempted_store_blocks"] == 4 and st["stored_bytes"] == 0 and st["external_hit_tokens"] == 0
    assert not e.scheduler.connector.scheduler.cpu.cached_block_hash_to_block
    assert_no_leak(e)


def test_unscheduled_victim_stores_only_blocks_already_written(model_dir):
    """Priority preemption of a request already scheduled in the step: the block its decode was to
    fill in that step is never written, so neither the device prefix cache nor the host tier may
    keep it (a later request sharing that block would read garbage)."""
    r = random.Random(5)
    low = [r.randrange(1, 500) for _ in range(30)]
    high = [r.randrange(1, 500) for _ in range(96)]
    finals = {}
    for conn in (None, "offload"):
        e = engine(model_dir, kv_connector=conn, kv_connector_config={"cpu_bytes": MB} if conn else None,
                   scheduling_policy="priority")
        e.add_request("low", low, greedy(4), priority=1)
        e.step()  # low prefills 30 tokens, samples 1
        e.add_request("high", high, greedy(4), priority=0)
        e.step()  # low decodes (31), high prefills: 2 + 6 = 8 blocks
        (req,) = [r for r in e.scheduler.requests.values() if r.request_id.startswith("low")]
        e.step()  # low's decode fills block 1; then high needs a 7th block and low (scheduled) is the victim
        assert e.scheduler.num_preemptions == 1 and req.num_preemptions == 1
        sharer = list(req.all_token_ids[:32]) + [7, 8, 9]  # shares low's blocks 0 and 1
        e.add_request("sharer", sharer, greedy(4))
        got = drain(e)
        finals[conn] = {o.request_id: o.token_ids for o in got if o.finished}
        if conn:
            assert e.stats()["kv_connector"]["preempted_store_blocks"] == 1  # block 0 only
            assert_no_leak(e)
        want = engine(model_dir).generate([sharer], greedy(4), use_tqdm=False)[0].token_ids
        assert finals[conn]["sharer"] == want
    assert finals["offload"] == finals[None]



@pytest.mark.timeout(240)
def test_preemption_store_runs_on_every_tensor_parallel_rank(model_dir, reference):
    """At tp=2 every rank copies its own shard of the preempted request's blocks (the early stores
    travel in the metadata the ranks decode), and the job completes once both ranks reported it."""
    e = engine(model_dir, tensor_parallel_size=2, kv_connector="offload", kv_connector_config={"cpu_bytes": MB})
    try:
        assert run_a_then_b(e) == reference
        st = e.stats()["kv_connector"]
        assert st["preempted_store_blocks"] == 4 and st["external_hit_tokens"] == 4 * 16
        assert_no_leak(e)
        assert e.runner.kv_outputs.pending() == 0
    finally:
        e.close()


@pytest.mark.parametrize("preempt", [False, True], ids=["finished", "preempted"])
def test_blocks_computed_on_a_load_still_in_flight_are_stored_once_it_lands(model_dir, preempt):
    """On a device a synchronous load's event often fires steps after the step that used it: a
    request that finishes (or is preempted) before then still gets the blocks it computed on top of
    the loaded prefix stored — parked, device blocks pinned, until the load is confirmed."""
    from .conftest import workload
    from .test_offload import gated_engine

    conn = OffloadConnector(cpu_bytes=MB)
    e, gate = gated_engine(model_dir, conn, num_kv_blocks=16)
    p = workload()
    e.generate([p[1]], greedy(1), use_tqdm=False)  # the prefix (and more) into the tier
    for _ in range(5):
        e.step()
    assert e.kv_cache_manager.reset_prefix_cache()  # the prefix is in the host tier only
    before = set(conn.scheduler.cpu.cached_block_hash_to_block)
    x = p[1][:64] + [random.Random(6).randrange(1, 500) for _ in range(50)]  # 4 loaded blocks + 3 computed full ones
    gate[0] = False
    e.add_request("x", x, greedy(1 if not preempt else 8))
    e.step()  # x: loads 4 blocks (event pending), computes the rest, samples
    (load,) = [j for j in conn.scheduler._jobs.values() if j.load]
    if preempt:
        (req,) = [r for r in e.scheduler.requests.values() if r.request_id.startswith("x")]
        e.scheduler.running.remove(req)
        e.scheduler._preempt(req)  # as the scheduler does when another request needs the blocks
    else:
        e.step()  # x's one token: finished
    stores = [j for j in conn.scheduler._jobs.values() if not j.load]
    assert len(stores) == 1 and len(stores[0].device) == 3  # parked behind the load, device blocks pinned
    assert all(b.ref_cnt >= 1 for b in stores[0].device)
    gate[0] = True
    drain(e)
    new = set(conn.scheduler.cpu.cached_block_hash_to_block) - before
    assert len(new) == 3 and load.job_id not in conn.scheduler._jobs
    assert_no_leak(e)

"""Differential random traces with a hybrid model (Gemma-3-shaped: two window-16 layers and a global
one): prefix caching + offload (with KV-cache groups: a host tier per group), pool and P/D, with load
failures injected at random, give exactly the tokens of a plain engine (no prefix cache, no
connector), and leave no block, host pin or pool hold behind. Seeded (bounded for CI): each seed is
a trace of prompts over a few shared prefixes, so device hits, host-tier hits, pool hits and misses
all happen, under a device pool small enough to evict."""

from __future__ import annotations

import random

import pytest
import torch

import hwkv
from hwkv.connectors.offload import OffloadConnector
from hwkv.connectors.offload.worker import OffloadWorker
from hwkv.connectors.pool.store import drop_embedded, embedded_store
from hwkv.interfaces.store import ItemResult, KeyNotFound
from hwkv.testing.mooncake import mooncake_available

from .conftest import BS, assert_no_leak, engine, greedy, group_block_bytes
from .test_pool import Flaky, _close, _settle

transformers = pytest.importorskip("transformers")

SEEDS = [0, 1, 2]


def trace(seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: prompts over three shared prefixes of 1-4 blocks (+ a partial one),
    some after a filler that takes most of an 8-block device pool (the prefix must come from elsewhere)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randint(BS, 4 * BS + 5))] for _ in range(3)]
    out = []
    for _ in range(7):
        if rng.random() < 0.5:
            out.append(([rng.randrange(3, 500) for _ in range(100)], 1))
        out.append((rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))],
                    rng.randint(1, 6)))
    return out


def run(e: hwkv.Engine, steps: list[tuple[list[int], int]], before=None) -> list[list[int]]:
    out = []
    for i, (p, n) in enumerate(steps):
        if before:
            before(i)
        out.append(e.generate([p], greedy(n), use_tqdm=False)[0].token_ids)
    return out


@pytest.fixture(scope="module")
def plain(hybrid_dir):
    e = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    assert e.model.attention_features == ("sliding_window",)
    assert [e.model.config.window_of(i) for i in range(3)] == [16, 16, None]
    return {s: run(e, trace(s)) for s in SEEDS}


class RandomFailWorker(OffloadWorker):
    rng = random.Random(0)
    p = 0.0

    first = False  # the first load fails whatever the draw (a trace with few loads still fails one)

    def load_blocks(self, host_ids, device_ids, layer=None):
        first, self.first = self.first, False
        if self.rng.random() < self.p or first:
            raise RuntimeError("injected load failure")
        super().load_blocks(host_ids, device_ids, layer)


class RandomFailOffload(OffloadConnector):
    worker_cls = RandomFailWorker

    def __init__(self, seed: int, p: float, first: bool = False, **kw):
        super().__init__(**kw)
        self.worker.rng, self.worker.p, self.worker.first = random.Random(seed), p, first


@pytest.mark.parametrize("seed", SEEDS)
def test_offload_with_random_load_failures(hybrid_dir, plain, seed):
    e = engine(hybrid_dir, num_kv_blocks=8, kv_connector=RandomFailOffload(seed, 0.4, first=True, cpu_bytes=1 << 20))
    assert [g.window for g in e.config.kv_groups] == [None, 16]  # KV-cache groups with the connector
    assert run(e, trace(seed)) == plain[seed]
    st = e.stats()["kv_connector"]
    assert st["load_failures"] > 0 and st["hit_blocks"] > 0  # host hits were offered and failures hit
    assert_no_leak(e)


def test_offload_groups_load_every_groups_blocks(hybrid_dir, plain):
    """No failures: host hits load both groups' blocks (the window group only its window)."""
    e = engine(hybrid_dir, num_kv_blocks=8, kv_connector=RandomFailOffload(0, 0.0, cpu_bytes=1 << 20))
    assert run(e, trace(0)) == plain[0]
    st = e.stats()["kv_connector"]
    assert st["load_jobs"] > 0 and st["load_failures"] == 0 and st["external_hit_tokens"] > 0
    assert all(t.cached_block_hash_to_block for t in e.scheduler.connector.scheduler.cpus)
    assert all(n > 0 for n in st["cpu_cached_blocks_per_group"]) and len(st["cpu_cached_blocks_per_group"]) == 2
    assert_no_leak(e)


class LoseSome(Flaky):
    """:class:`Flaky`, and with ``p`` each key of a get is lost on its own (a get fails part-way: the
    chunks before the first lost one land); ``got`` counts the keys asked per KV-cache group tag."""

    def __init__(self, inner, seed: int):
        super().__init__(inner)
        self.rng, self.p, self.got = random.Random(seed), 0.0, {}

    def get(self, keys, buffers):
        for k in keys:
            tag = k.rsplit("@", 2)[-2]
            self.got[tag] = self.got.get(tag, 0) + 1
        lost = [self.p > 0 and self.rng.random() < self.p for _ in keys]
        if self.lose_gets or not any(lost):
            return super().get(keys, buffers)
        res = iter(super().get([k for k, x in zip(keys, lost) if not x], [b for b, x in zip(buffers, lost) if not x]))
        return [ItemResult(k, 0, KeyNotFound(f"key {k!r} not found")) if x else next(res) for k, x in zip(keys, lost)]


def _assert_both_groups_loaded(a: hwkv.Engine, b: hwkv.Engine, flaky) -> None:
    """After ``b`` served from ``a``'s pool chunks with gets lost: it hit and failed, it loaded both groups
    (the window group, one block of window 16, less than the full one), and neither engine holds anything."""
    flaky.lose_gets, flaky.p = False, 0.0
    sb = _settle(b)
    assert sb["external_hit_tokens"] > 0 and sb["load_failures"] > 0
    assert 0 < flaky.got["g1-w16"] < flaky.got["g0-full"]
    for e in (a, b):
        assert_no_leak(e)


@pytest.mark.parametrize("seed", SEEDS)
def test_pool_groups_with_random_lost_keys(hybrid_dir, plain, seed, request):
    """The pool with KV-cache groups (each group's chunks under its own keys): a second instance hits
    the first one's chunks of both groups while whole gets and single keys are lost at random."""
    name = f"hybrid-diff-{seed}-{request.node.name}"
    flaky = LoseSome(embedded_store(name), seed)
    # one get at a time (load_parallel 1): LoseSome loses keys in the order of get calls
    kw = dict(num_kv_blocks=16, kv_connector="pool", kv_connector_config={"store": flaky, "load_parallel": 1})
    a, b = engine(hybrid_dir, **kw), engine(hybrid_dir, **kw)
    rng = random.Random(seed)
    try:
        assert [g.window for g in b.config.kv_groups] == [None, 16]  # KV-cache groups with the connector
        steps = trace(seed)
        assert run(a, steps) == plain[seed]  # fills the pool (and hits its own device cache)
        _settle(a)

        def maybe_lose(_i):
            r = rng.random()
            flaky.lose_gets, flaky.p = r < 0.2, 0.3 if r < 0.6 else 0.0

        assert run(b, steps, maybe_lose) == plain[seed]  # a second instance: pool hits, some lost
        _assert_both_groups_loaded(a, b, flaky)
    finally:
        _close(a, b)
        drop_embedded(name)


@pytest.mark.skipif(not mooncake_available()[0], reason="P/D needs the Mooncake transfer engine")
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_with_random_failed_reads(hybrid_dir, plain, mode):
    from hwkv.interfaces.transfer import TransferError

    from .test_p2p_engine import assert_clean, cfg, decode, prefill

    seed = SEEDS[0]
    p = engine(hybrid_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("producer", mode, part_tokens=16))  # loads in parts of a block or more
    d = engine(hybrid_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("consumer", mode, transfer_timeout_s=0.3, part_tokens=16))
    assert [g.window for g in d.config.kv_groups] == [None, 16]  # KV-cache groups on both sides
    rng = random.Random(seed)
    conn = (d if mode == "pull" else p).scheduler.connector.worker  # the worker side owns the transfer
    real = conn.transfer.read if mode == "pull" else conn.transfer.write
    fail = {"at": 0, "calls": 0}  # the load's copy (it copies in token-ordered parts) that fails; 0: none

    def flaky(*args, **kw):
        fail["calls"] += 1
        if fail["calls"] == fail["at"]:
            raise TransferError("injected transfer failure")
        return real(*args, **kw)

    setattr(conn.transfer, "read" if mode == "pull" else "write", flaky)
    try:
        got = []
        for prompt, n in trace(seed):
            fail["at"], fail["calls"] = rng.choice([0, 0, 1, 2, 3, 4]), 0  # a failed part keeps those before it
            params = prefill(p, prompt)
            got.append(decode(d, prompt, params, n=n))
        fail["at"] = 0
        assert got == plain[seed]
        st = d.stats()["kv_connector"]
        assert st["load_failures"] > 0 and st["load_kept_tokens"] > 0
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_offload_window_blocks_before_the_loaded_window_are_never_hits(hybrid_dir):
    """A 4-block host hit loads the window group's last block only; its table entries before that
    window were never loaded, so they must not become prefix-cache entries (a later request hitting 2
    of those blocks on the device would read the window group's block 1 unloaded)."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(4 * BS + 3)]
    steps = [(prefix, 2), ([rng.randrange(3, 500) for _ in range(100)], 1), (prefix, 2),
             (prefix[:2 * BS] + [7, 9], 3)]
    want = run(engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False), steps)
    e = engine(hybrid_dir, num_kv_blocks=8, kv_connector=RandomFailOffload(0, 0.0, cpu_bytes=1 << 20))
    assert run(e, steps) == want
    st = e.stats()
    # the device has the full group's 2 blocks but not the window group's block 1: no device hit,
    # the host tier serves both groups (4 + 2 blocks)
    assert st["prefix_cache_hits"] == 0 and st["kv_connector"]["hit_blocks"] == 6
    assert_no_leak(e)


@pytest.mark.parametrize("async_load", [False, True])
def test_offload_groups_concurrent_requests_preempt_and_match(hybrid_dir, async_load):
    """Requests at once over shared prefixes in a 12-block device pool that preempts, then some again
    (host hits): tokens equal to a plain engine, nothing leaked, synchronous or asynchronous loads."""
    rng = random.Random(9)
    prefixes = [[rng.randrange(3, 500) for _ in range(3 * BS + 2)] for _ in range(2)]
    prompts = [rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))] for _ in range(6)]
    plain_e = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    want = [o.token_ids for o in plain_e.generate(prompts, greedy(12), use_tqdm=False)]
    e = engine(hybrid_dir, num_kv_blocks=12, kv_connector="offload",
               kv_connector_config={"cpu_bytes": 1 << 20, "async_load": async_load})
    assert e.config.kv_groups
    assert [o.token_ids for o in e.generate(prompts, greedy(12), use_tqdm=False)] == want
    again = [o.token_ids for o in e.generate(prompts[:3], greedy(12), use_tqdm=False)]
    assert again == want[:3]
    st = e.stats()
    assert st["num_preemptions"] > 0 and st["kv_connector"]["load_failures"] == 0
    assert st["kv_connector"]["load_jobs"] > 0  # host hits of both groups (the device pool evicted them)
    assert_no_leak(e)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_offload_loads_every_groups_bytes(hybrid_dir, layerwise):
    """The loaded blocks of each group hold exactly the KV a recompute writes (the full group's 4
    prefix blocks, the window group's last one): tokens alone do not show a missing window load with
    this tiny model."""
    from .test_offload_layerwise import lazy_engine

    rng = random.Random(4)
    prefix = [rng.randrange(3, 500) for _ in range(4 * BS)]
    prompt = prefix + [rng.randrange(3, 500) for _ in range(5)]
    ref = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    ref.add_request("p", prompt, greedy(4))
    ref.step()
    want = group_block_bytes(ref, next(iter(ref.scheduler.requests)))  # the engine's id for the request
    e, _ = lazy_engine(hybrid_dir, layerwise_load=layerwise)
    run(e, [(prompt, 1), ([rng.randrange(3, 500) for _ in range(118)], 1)])  # stored, then evicted
    e.add_request("p", prompt, greedy(4))
    e.step()  # loads the 4 prefix blocks from the host tier, computes the rest
    got = group_block_bytes(e, next(iter(e.scheduler.requests)))
    assert e.stats()["kv_connector"]["load_jobs"] >= 1
    loaded = {0: range(4), 1: range(3, 4)}  # window 16 = one block: the next query sees block 3 only
    for g, blocks in loaded.items():
        for i in blocks:
            assert got[g][i] is not None, (g, i)
            for a, b in zip(got[g][i], want[g][i]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"group {g} block {i}")
    while e.has_unfinished():
        e.step()
    assert_no_leak(e)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_trace_harness_with_offload_and_pool_failing_loads(hybrid_dir, seed, request):
    """The engine's random-trace harness (requests arriving between steps, random aborts, chunk
    budgets, 4-token blocks so the window group holds 4 blocks, a pool small enough to preempt and
    evict) through connectors with KV-cache groups and failing loads: offload (loads failing at
    random, synchronous or asynchronous) and the pool (a second instance, whole gets and single keys
    lost at random; chunks of one block or three), each trace run twice - every finished request's
    tokens are a plain engine's (one group, no prefix cache, no connector), and nothing is left held."""
    from tests.engine.test_engine_kv_groups import make_random_trace, run_random_trace

    rng = random.Random(seed)
    reqs, aborts, want = make_random_trace(rng, hybrid_dir, 16, 10, max_model_len=64)
    kw = dict(backend="cpu", dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=24,
              max_num_batched_tokens=rng.choice([16, 24, 80]))
    off = hwkv.Engine(hybrid_dir, kv_connector=RandomFailOffload(seed, 0.3, first=True, cpu_bytes=1 << 20,
                                                                  async_load=bool(seed % 2)), **kw)
    assert [g.window for g in off.config.kv_groups] == [None, 16]
    for _ in range(2):
        run_random_trace(off, reqs, want, aborts, rng)
    st = off.stats()
    assert st["kv_connector"]["load_failures"] > 0 and st["kv_connector"]["hit_blocks"] > 0
    assert st["num_preemptions"] > 0
    assert_no_leak(off)

    name = f"hybrid-harness-{seed}-{request.node.name}"
    flaky = LoseSome(embedded_store(name), seed)
    # chunks of one block (seed 0) or three (seed 1: a window's first chunk starts before the window)
    pool = dict(kw, kv_connector="pool", kv_connector_config={"store": flaky, "chunk_size": 4 * (1 + 2 * seed),
                                                               "load_parallel": 1})  # losses in get-call order
    a, b = hwkv.Engine(hybrid_dir, **pool), hwkv.Engine(hybrid_dir, **pool)
    try:
        run_random_trace(a, reqs, want, aborts, rng)
        _settle(a)
        flaky.p = 0.3
        for i in range(2):
            flaky.lose_gets = i == 0 and seed == 0  # every get of one pass lost (seed 0), single keys always
            run_random_trace(b, reqs, want, aborts, rng)
        _assert_both_groups_loaded(a, b, flaky)
    finally:
        _close(a, b)
        drop_embedded(name)

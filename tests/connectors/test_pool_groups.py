"""The pool connector with KV-cache groups (a Gemma-3-shaped model: a full group and a window-16
group) and a load that fails part-way: each group's chunks under their own keys, a hit loads the
full group's chunks and the window group's window only with exactly the bytes a recompute writes,
and a failed chunk recomputes from that chunk on (as far as every group's blocks allow), tokens
identical to a plain engine, nothing leaked."""

from __future__ import annotations

import random

import pytest
import torch

import hwkv
from hwkv.connectors.pool.store import drop_embedded, embedded_store
from hwkv.interfaces.store import ItemResult, KeyNotFound

from .conftest import BS, assert_no_leak, engine, greedy, group_block_bytes
from .test_pool import PROMPT, Flaky, _close, _settle

pytest.importorskip("transformers")


class Recording(Flaky):
    """Records the keys put and asked; ``lose``: positions among the keys asked from now on (over every
    get call: a staged load asks in pieces) answered not found (the get fails part-way: the keys before
    the first lost one land)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.put_keys: list[str] = []
        self.got: list[str] = []
        self._lose: set[int] = set()
        self._asked = 0

    @property
    def lose(self) -> set[int]:
        return self._lose

    @lose.setter
    def lose(self, positions: set[int]) -> None:
        self._lose, self._asked = set(positions), 0

    def put(self, keys, buffers):
        self.put_keys += keys
        return super().put(keys, buffers)

    def get(self, keys, buffers):
        self.got += keys
        lose = {p - self._asked for p in self._lose if 0 <= p - self._asked < len(keys)}
        self._asked += len(keys)
        if not lose:
            return super().get(keys, buffers)
        keep = [i for i in range(len(keys)) if i not in lose]
        res = iter(super().get([keys[i] for i in keep], [buffers[i] for i in keep]))
        return [ItemResult(k, 0, KeyNotFound(f"key {k!r} lost")) if i in lose else next(res)
                for i, k in enumerate(keys)]


def tag(key: str) -> str:
    return key.rsplit("@", 2)[-2]


@pytest.fixture
def store(request):
    name = f"pool-groups-{request.node.name}"
    yield Recording(embedded_store(name))
    drop_embedded(name)


def pool_engine(model: str, store: Recording, mode: str = "direct", **kw) -> hwkv.Engine:
    """``mode``: how values move - ``direct`` (the store reads and writes the CPU KV cache), ``staged``
    (the accelerator path: 32 KiB of host staging, so a get runs in several pieces) or ``packed``
    (one segment per value, scattered on the device)."""
    cfg = {"store": store, "load_parallel": 1}  # Recording loses chunks by their place in the order of get calls
    if mode != "direct":
        cfg.update(staging_bytes=1 << 15, pack=mode == "packed")  # the Llama's: 4 blocks, gets of 2 chunks
    e = engine(model, num_kv_blocks=kw.pop("num_kv_blocks", 32), kv_connector="pool", kv_connector_config=cfg, **kw)
    assert e.scheduler.connector.worker.transfer.direct is (mode == "direct")
    assert e.scheduler.connector.worker.transfer.packed is (mode == "packed")
    return e


@pytest.fixture(params=["direct", "staged", "packed"])
def mode(request, monkeypatch):
    if request.param != "direct":
        monkeypatch.setattr("hwkv.connectors.pool.transfer.host_addressable", lambda kv: False)
    return request.param


def run(e: hwkv.Engine, prompt: list[int], n: int = 4):
    return e.generate([prompt], greedy(n), use_tqdm=False)[0]


def test_each_groups_chunks_under_its_own_keys_and_the_window_loads_only_its_window(hybrid_dir, store, mode):
    rng = random.Random(4)
    prompt = [rng.randrange(3, 500) for _ in range(4 * BS + 5)]
    ref = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    ref.add_request("p", prompt, greedy(4))
    ref.step()
    want = group_block_bytes(ref, next(iter(ref.scheduler.requests)))
    a, b = pool_engine(hybrid_dir, store, mode), pool_engine(hybrid_dir, store, mode)
    try:
        assert [g.window for g in b.config.kv_groups] == [None, 16]
        plain = run(a, prompt).token_ids
        _settle(a)
        # every chunk of each group (a window block is still held when its chunk is put), under its group's key:
        # the group's tag and its own layer count (layer 2 is global, layers 0-1 windowed)
        tags = sorted({tag(k) for k in store.put_keys})
        assert tags == ["g0-full", "g1-w16"]
        assert all(":L1H" in k for k in store.put_keys if tag(k) == "g0-full")
        assert all(":L2H" in k for k in store.put_keys if tag(k) == "g1-w16")
        assert sum(tag(k) == "g0-full" for k in store.put_keys) == sum(tag(k) == "g1-w16" for k in store.put_keys) == 4
        b.add_request("p", prompt, greedy(4))
        for _ in range(20):  # the load, then the prefill step over it
            b.step()
            rid = next(iter(b.scheduler.requests))
            if b.scheduler.requests[rid].num_computed_tokens >= len(prompt):
                break
        got = group_block_bytes(b, rid)
        # the full group's 4 prefix chunks; the window group's last one only (window 16 = one block)
        assert sorted(tag(k) for k in store.got) == ["g0-full"] * 4 + ["g1-w16"]
        for g, blocks in {0: range(4), 1: range(3, 4)}.items():
            for i in blocks:
                assert got[g][i] is not None, (g, i)
                for x, y in zip(got[g][i], want[g][i]):
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"group {g} block {i}")
        while b.has_unfinished():
            b.step()
        assert b.stats()["kv_connector"]["external_hit_tokens"] == 4 * BS
        # the window group's entries before its loaded window were never loaded: never prefix-cache entries
        # (a 2-block device hit would read its block 1); the pool serves those 2 blocks instead
        short = prompt[:2 * BS] + [7, 9]
        hits = b.stats()["prefix_cache_hits"]
        assert run(b, short, 3).token_ids == run(ref, short, 3).token_ids
        assert b.stats()["prefix_cache_hits"] == hits and b.stats()["kv_connector"]["external_hit_tokens"] == 6 * BS
        assert run(a, prompt).token_ids == plain
        for e in (a, b):
            _settle(e)
            assert_no_leak(e)
    finally:
        _close(a, b)


@pytest.mark.parametrize("lost", [0, 5, 8])
def test_a_lost_chunk_recomputes_from_that_chunk(model_dir, store, lost, mode):
    """One group (a Llama): chunk ``lost`` of 9 is gone when the load runs; the chunks before it landed
    (staged: in pieces of two chunks, a failing piece's good first one too) and stay as prefix-cache
    entries, so the request recomputes from chunk ``lost`` on (its prompt's cached tokens say so), with
    the plain engine's tokens."""
    plain = run(engine(model_dir, num_kv_blocks=64, max_model_len=256), PROMPT).token_ids
    a, b = (pool_engine(model_dir, store, mode, max_model_len=256) for _ in range(2))
    try:
        assert run(a, PROMPT).token_ids == plain
        _settle(a)
        store.lose = {lost}
        out = run(b, PROMPT)
        assert out.token_ids == plain
        assert out.metrics.num_cached_tokens == lost * BS  # re-admitted on the landed chunks' device hit
        st = _settle(b)
        assert st["load_failures"] == 1 and st["external_hit_tokens"] == 0 and st["load_kept_tokens"] == lost * BS
        assert_no_leak(b)
        assert run(b, PROMPT).token_ids == plain  # the kept blocks are good prefix-cache entries
    finally:
        _close(a, b)


@pytest.mark.parametrize("group", ["g0-full", "g1-w16"])
def test_a_lost_chunk_of_either_group_recomputes_what_every_group_needs(hybrid_dir, store, group):
    """Two groups: the full group's chunk 2 (of 4) or the window group's one chunk is lost. The full
    group's landed chunks are valid, but resuming at chunk 2 needs the window group's block 1, which
    the load never fetched (it loads the window before block 4 only): the hit every group serves is
    the device's, so the request recomputes its prompt - and gives the plain engine's tokens."""
    rng = random.Random(6)
    prompt = [rng.randrange(3, 500) for _ in range(4 * BS + 5)]
    plain = run(engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False), prompt).token_ids
    a, b = pool_engine(hybrid_dir, store), pool_engine(hybrid_dir, store)
    try:
        assert run(a, prompt).token_ids == plain
        _settle(a)
        real = store.get

        def get(keys, buffers):
            i = [j for j, k in enumerate(keys) if tag(k) == group]
            if i:
                store.lose = {i[min(2, len(i) - 1)]}
            return real(keys, buffers)

        store.get = get
        out = run(b, prompt)
        store.get = real
        assert out.token_ids == plain and out.metrics.num_cached_tokens == 0
        st = _settle(b)
        # kept: the full group's chunks before the lost one (2), or every full-group chunk before the
        # window's lost one (3); the window group's blocks before them were never loaded, so no hit
        assert st["load_failures"] == 1 and st["load_kept_tokens"] == (2 if group == "g0-full" else 3) * BS
        assert_no_leak(b)
        assert run(b, prompt).token_ids == plain
    finally:
        _close(a, b)

"""The `pool` connector on the embedded store: sharing across engines, isolation (salts, models,
dtypes), dedup, failures (evicted keys, a store that goes away and comes back), no leaked pins."""

from __future__ import annotations

import time
from typing import Any

import pytest

import hwkv
from hwkv import SamplingParams
from hwkv.connectors.pool.key import PoolKey, default_model_id
from hwkv.connectors.pool.lookup import LookupClient
from hwkv.connectors.pool.store import drop_embedded, embedded_store
from hwkv.interfaces.store import ItemResult, KeyNotFound, Store, StoreError
from hwkv.model.tiny import write_tiny_model

BS = 16
PROMPT = [(7 * i + 3) % 500 + 1 for i in range(150)]  # 9 full blocks before the last token
GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("pool") / "m", seed=0))


@pytest.fixture(scope="module")
def oracle(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS)
    return lambda prompt, salt=None: e.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, cache_salt=salt), use_tqdm=False)[0].token_ids


@pytest.fixture
def store_name(request):
    name = f"test-{request.node.name}"
    yield name
    drop_embedded(name)


class Flaky(Store):
    """Delegates to an embedded store; ``down`` makes every call fail, ``lose_gets`` answers gets
    with KeyNotFound (evicted between lookup and load)."""

    def __init__(self, inner: Store):
        self.inner, self.down, self.lose_gets, self.puts = inner, False, False, 0

    def _check(self) -> None:
        if self.down:
            raise StoreError("injected: store unreachable")

    def put(self, keys, buffers):
        self._check()
        self.puts += len(keys)
        return self.inner.put(keys, buffers)

    def get(self, keys, buffers):
        self._check()
        if self.lose_gets:
            return [ItemResult(k, 0, KeyNotFound(f"key {k!r} not found")) for k in keys]
        return self.inner.get(keys, buffers)

    def exists(self, keys):
        self._check()
        return self.inner.exists(keys)

    def remove(self, keys):
        return self.inner.remove(keys)

    def close(self):
        pass


def _engine(model_dir: str, **cfg: Any) -> hwkv.Engine:
    dtype, async_scheduling = cfg.pop("dtype", None), cfg.pop("async_scheduling", None)
    return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, dtype=dtype,
                       async_scheduling=async_scheduling, kv_connector="pool", kv_connector_config=cfg)


def _run(e: hwkv.Engine, prompt: list[int], salt: str | None = None) -> list[int]:
    sp = SamplingParams(max_tokens=6, temperature=0, cache_salt=salt)
    return e.generate([prompt], sp, use_tqdm=False)[0].token_ids


def _settle(e: hwkv.Engine, timeout_s: float = 10.0) -> dict[str, Any]:
    """Step the idle engine until every pool transfer completed; then nothing may stay pinned."""
    conn, deadline = e.scheduler.connector, time.monotonic() + timeout_s
    while conn.has_pending_transfers():
        assert time.monotonic() < deadline, "pool transfers did not complete"
        e.step()
        time.sleep(0.005)
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks  # no leaked blocks or pins
    return e.stats()["kv_connector"]


def _close(*engines: hwkv.Engine) -> None:
    for e in engines:
        e.scheduler.connector.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_second_engine_loads_the_first_ones_prefix(model_dir, oracle, store_name, async_scheduling):
    a = _engine(model_dir, store_name=store_name, async_scheduling=async_scheduling)
    b = _engine(model_dir, store_name=store_name, async_scheduling=async_scheduling)
    try:
        assert _run(a, PROMPT) == oracle(PROMPT)
        sa = _settle(a)
        assert sa["stored_chunks"] == 9 and sa["stored_bytes"] == 9 * a.kv_cache.spec.bytes_per_block
        assert sa["external_hit_tokens"] == 0
        assert _run(b, PROMPT) == oracle(PROMPT)
        sb = _settle(b)
        assert sb["external_hit_tokens"] == 9 * BS and sb["loaded_bytes"] == sa["stored_bytes"]
        assert sb["stored_bytes"] == 0 and sb["dedup_local"] == 9  # loaded chunks are never put back
        # a longer prompt sharing the prefix: the prefix loads, only the new chunks are put
        longer = PROMPT + [11] * 40
        assert _run(b, longer) == oracle(longer)  # b's own prefix cache holds PROMPT now
        assert _run(a, longer[:-1]) == oracle(longer[:-1])
        assert _settle(a)["load_failures"] == 0
    finally:
        _close(a, b)


def test_a_load_then_its_tail_in_a_graph(model_dir, oracle, store_name):
    """Graphs on (the engine's default where the backend captures): the pool keeps them and async
    scheduling, and a restarted engine's load is followed by its one-token tail as a graph replay."""
    from hwkv.reference.graphs import GraphCpuBackend

    a = _engine(model_dir, store_name=store_name)
    b = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, backend=GraphCpuBackend(),
                    fuse_elementwise=False, kv_connector="pool", kv_connector_config={"store_name": store_name})
    try:
        assert b.runner.graphs is not None and b.async_scheduling
        assert _run(a, PROMPT) == oracle(PROMPT)
        _settle(a)
        before = b.runner.num_tail_graph_steps
        first = b.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].token_ids
        assert first == oracle(PROMPT)[:1]
        sb = _settle(b)
        assert sb["external_hit_tokens"] == 9 * BS and sb["load_failures"] == 0
        assert b.runner.num_tail_graph_steps == before + 1  # the tail (6 tokens after 144 loaded): a replay
    finally:
        _close(a, b)


def test_salted_tenants_never_share(model_dir, oracle, store_name):
    a, b = _engine(model_dir, store_name=store_name), _engine(model_dir, store_name=store_name)
    try:
        assert _run(a, PROMPT, salt="tenant-a") == oracle(PROMPT, "tenant-a")
        _settle(a)
        assert _run(b, PROMPT, salt="tenant-b") == oracle(PROMPT, "tenant-b")
        assert _run(b, PROMPT) == oracle(PROMPT)  # unsalted: no hit either
        assert _settle(b)["external_hit_tokens"] == 0
        c = _engine(model_dir, store_name=store_name)
        try:
            assert _run(c, PROMPT, salt="tenant-a") == oracle(PROMPT, "tenant-a")  # same salt: shared
            assert _settle(c)["external_hit_tokens"] == 9 * BS
        finally:
            _close(c)
    finally:
        _close(a, b)


def test_other_model_or_dtype_never_hits(model_dir, tmp_path, store_name):
    other = str(write_tiny_model(tmp_path / "other", seed=1))  # same architecture, other weights
    assert default_model_id(other) != default_model_id(model_dir)
    a = _engine(model_dir, store_name=store_name)
    b = _engine(other, store_name=store_name)
    c = _engine(model_dir, store_name=store_name, dtype="bfloat16")
    try:
        _run(a, PROMPT)
        _settle(a)
        _run(b, PROMPT)
        _run(c, PROMPT)
        assert _settle(b)["external_hit_tokens"] == 0 and _settle(c)["external_hit_tokens"] == 0
        assert embedded_store(store_name).stats()["num_keys"] == 3 * 9  # three disjoint key spaces
    finally:
        _close(a, b, c)


def test_dedup_a_chunk_already_in_the_pool_moves_no_bytes(model_dir, oracle, store_name):
    flaky = Flaky(embedded_store(store_name))
    a = _engine(model_dir, store=flaky)
    try:
        _run(a, PROMPT)
        _settle(a)
        assert flaky.puts == 9
        used = embedded_store(store_name).stats()["used_bytes"]
        b = _engine(model_dir, store=flaky)  # its loads fail, so it recomputes the chunks and offers them
        try:
            flaky.lose_gets = True
            assert _run(b, PROMPT) == oracle(PROMPT)
            sb = _settle(b)
            assert sb["load_failures"] == 1 and sb["dedup_pool"] == 9 and sb["stored_bytes"] == 0
            assert flaky.puts == 9 and embedded_store(store_name).stats()["used_bytes"] == used
        finally:
            _close(b)
    finally:
        _close(a)


def lost_keys_recompute(model_dir: str, want: list[int], store_name: str) -> None:
    """The first engine fills the pool; its keys are gone when the second engine's load runs (after
    the lookup found them): the second recomputes at once and gives ``want``."""
    flaky = Flaky(embedded_store(store_name))
    a, b = _engine(model_dir, store=flaky), _engine(model_dir, store=flaky)
    try:
        _run(a, PROMPT)
        _settle(a)
        flaky.lose_gets = True
        t0 = time.monotonic()
        assert _run(b, PROMPT) == want
        assert time.monotonic() - t0 < 5
        sb = _settle(b)
        assert sb["load_failures"] == 1 and sb["failed_loads"] == 1 and sb["external_hit_tokens"] == 0
    finally:
        _close(a, b)


def test_keys_evicted_between_lookup_and_load_recompute(model_dir, oracle, store_name):
    lost_keys_recompute(model_dir, oracle(PROMPT), store_name)


def test_store_down_then_back(model_dir, oracle, store_name):
    flaky = Flaky(embedded_store(store_name))
    a = _engine(model_dir, store=flaky, retry_s=0.2)
    b = _engine(model_dir, store=flaky, retry_s=0.2)
    try:
        flaky.down = True
        t0 = time.monotonic()
        assert _run(a, PROMPT) == oracle(PROMPT)  # serves without the pool
        assert time.monotonic() - t0 < 5
        sa = _settle(a)
        assert sa["store_up"] is False and sa["stored_bytes"] == 0 and sa["store_failures"] >= 1
        flaky.down = False
        time.sleep(0.3)  # past retry_s: the pool is used again
        other = PROMPT[::-1]
        assert _run(a, other) == oracle(other)
        assert _settle(a)["stored_chunks"] == 9
        assert _run(b, other) == oracle(other)
        assert _settle(b)["external_hit_tokens"] == 9 * BS
    finally:
        _close(a, b)


@pytest.mark.parametrize("staged", [False, True])
def test_chunks_larger_than_a_block(model_dir, oracle, store_name, staged, monkeypatch):
    if staged:  # the accelerator path: through host staging caches (one chunk each: several pieces)
        monkeypatch.setattr("hwkv.connectors.pool.transfer.host_addressable", lambda kv: False)
    a = _engine(model_dir, store_name=store_name, chunk_size=4 * BS, staging_bytes=1)
    b = _engine(model_dir, store_name=store_name, chunk_size=4 * BS, staging_bytes=1)
    try:
        assert a.scheduler.connector.worker.transfer.direct is not staged
        _run(a, PROMPT)
        assert _settle(a)["stored_chunks"] == 2  # 9 full blocks: 2 whole chunks of 4
        assert _run(b, PROMPT) == oracle(PROMPT)
        assert _settle(b)["external_hit_tokens"] == 8 * BS
    finally:
        _close(a, b)


@pytest.mark.parametrize("staged", [False, True])
def test_a_local_hit_ending_inside_a_chunk_loads_the_rest_of_it(model_dir, oracle, store_name, staged, monkeypatch):
    """b's device cache holds 6 blocks of the prompt, chunks are 4 blocks: the pool's second chunk is got
    whole and only its blocks 6 and 7 are written (4 and 5 are b's cached blocks, left as they are)."""
    if staged:
        monkeypatch.setattr("hwkv.connectors.pool.transfer.host_addressable", lambda kv: False)
    a = _engine(model_dir, store_name=store_name, chunk_size=4 * BS, staging_bytes=1)
    b = _engine(model_dir, store_name=store_name, chunk_size=4 * BS, staging_bytes=1)
    try:
        _run(a, PROMPT)
        assert _settle(a)["stored_chunks"] == 2
        head = PROMPT[:6 * BS + 3]
        assert _run(b, head) == oracle(head)  # loads chunk 0, computes blocks 4 and 5 (cached in b now)
        before = _settle(b)["lookup_hit_tokens"]
        assert _run(b, PROMPT) == oracle(PROMPT)
        st = _settle(b)  # nothing pinned: the chunk's leading (cached) blocks were pinned and released too
        assert st["lookup_hit_tokens"] - before == 2 * BS and st["failed_loads"] == 0
        assert _run(b, PROMPT) == oracle(PROMPT)  # the cached blocks 4 and 5 were not disturbed
    finally:
        _close(a, b)


@pytest.mark.parametrize("staged", [False, True])
def test_a_failed_load_behind_a_local_hit_inside_a_chunk_recomputes(model_dir, oracle, store_name, staged,
                                                                    monkeypatch):
    """The get of the partly cached chunk fails: the request recomputes from its local hit, the cached
    blocks (pinned during the load) are intact, nothing stays pinned."""
    if staged:
        monkeypatch.setattr("hwkv.connectors.pool.transfer.host_addressable", lambda kv: False)
    flaky = Flaky(embedded_store(store_name))
    a = _engine(model_dir, store=flaky, chunk_size=4 * BS, staging_bytes=1)
    b = _engine(model_dir, store=flaky, chunk_size=4 * BS, staging_bytes=1, save=False)
    try:
        _run(a, PROMPT)
        _settle(a)
        head = PROMPT[:6 * BS + 1]
        assert _run(b, head) == oracle(head)
        _settle(b)
        flaky.lose_gets = True
        assert _run(b, PROMPT) == oracle(PROMPT)
        st = _settle(b)
        assert st["failed_loads"] == 1 and st["load_failures"] == 1
        flaky.lose_gets = False
        assert _run(b, PROMPT) == oracle(PROMPT)  # its device cache, blocks 4 and 5 included, is sound
        _settle(b)
    finally:
        _close(a, b)


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("chunk_blocks", [3, 4])
def test_every_local_hit_length_gets_the_rest_from_the_pool(model_dir, oracle, store_name, staged, chunk_blocks,
                                                           monkeypatch):
    """The pool holds the prompt's whole chunks (blocks [0, covered)); b's device cache holds its first
    ``hit`` blocks, for every ``hit``: the pool gives exactly blocks [hit, covered), tokens are the
    oracle's, nothing stays pinned."""
    if staged:
        monkeypatch.setattr("hwkv.connectors.pool.transfer.host_addressable", lambda kv: False)
    cs = chunk_blocks * BS
    a = _engine(model_dir, store_name=store_name, chunk_size=cs, staging_bytes=1)
    b = _engine(model_dir, store_name=store_name, chunk_size=cs, staging_bytes=1, save=False)
    covered = 9 // chunk_blocks * chunk_blocks  # whole chunks of the prompt's 9 full blocks
    try:
        _run(a, PROMPT)
        _settle(a)
        for hit in range(1, 10):
            assert b.kv_cache_manager.reset_prefix_cache()
            head = PROMPT[:hit * BS + 1]
            assert _run(b, head) == oracle(head)
            before = _settle(b)["lookup_hit_tokens"]
            assert _run(b, PROMPT) == oracle(PROMPT), hit
            st = _settle(b)
            assert st["lookup_hit_tokens"] - before == max(0, covered - hit) * BS, hit
            assert st["failed_loads"] == 0
    finally:
        _close(a, b)


@pytest.mark.parametrize(("cfg", "msg"), [
    (dict(chunk_size=24), "chunk_size=24 is not a multiple of the block size 16"),
    (dict(store="redis"), "store='redis' is invalid (allowed: 'embedded', 'mooncake' or a Store instance)"),
    (dict(store="mooncake"), "store='mooncake' needs master='host:port'"),
    (dict(master="127.0.0.1:1"), "master do not apply to store='embedded'"),
    (dict(lookup_timeout_s=0), "lookup_timeout_s=0 is invalid"),
    (dict(model_id="a@b"), "model_id='a@b' is invalid"),
    (dict(colour="red"), "unknown config key(s) colour"),
])
def test_bad_config_is_refused(model_dir, cfg, msg):
    with pytest.raises(ValueError) as ei:
        _engine(model_dir, **cfg)
    assert msg in str(ei.value)


def test_pool_key_is_stable_and_names_everything():
    k = PoolKey("m-0123456789ab", "per_layer", "bfloat16", 32, 8, 128, 16, 2, 1, 4, 0)
    assert k.key(bytes(range(32))) == ("hwkv1@m-0123456789ab@per_layer:bfloat16:L32H8D128B16x2@tp1/4@pp0@"
                                       + bytes(range(32)).hex())
    with pytest.raises(ValueError, match="tp_rank=4 is invalid for tp_size=4"):
        PoolKey("m", "per_layer", "bfloat16", 32, 8, 128, 16, 1, 4, 4)


def test_lookup_without_a_server_is_a_bounded_miss():
    import zmq

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.REP)  # bound but never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        client = LookupClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2)
        t0 = time.monotonic()
        assert client.lookup([b"\0" * 32]) == 0 and client.lookup([b"\1" * 32]) == 0
        assert time.monotonic() - t0 < 2 and client.timeouts == 2
        client.close()
    finally:
        silent.close(linger=0)

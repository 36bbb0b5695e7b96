"""p2p connector between two engines in one process (tcp TransferEngine on loopback): the decode
engine continues from the prefill engine's KV with exactly the tokens one engine gives, in pull and
push mode; failures recompute; nothing stays held or pinned."""

from __future__ import annotations

import time

import pytest

import hwkv
from hwkv.testing.mooncake import skip_unless_mooncake

from .conftest import BS, engine, greedy

skip_unless_mooncake(allow_module_level=True)


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 16, 17, 47, 70)]


def cfg(role: str, mode: str, **kw) -> dict:
    return {"role": role, "mode": mode, "transfer_timeout_s": 3.0, **kw}


@pytest.fixture(scope="module")
def reference(model_dir):
    e = engine(model_dir, num_kv_blocks=16)
    return [o.token_ids for o in e.generate(prompts(), greedy(6), use_tqdm=False)]


def prefill(p: hwkv.Engine, prompt: list[int], salt: str | None = None) -> dict:
    sp = hwkv.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, cache_salt=salt,
                             kv_transfer_params={"do_remote_decode": True})
    out = p.generate([prompt], sp, use_tqdm=False)[0]
    assert out.kv_transfer_params and out.kv_transfer_params["do_remote_prefill"]
    return out.kv_transfer_params


def decode(d: hwkv.Engine, prompt: list[int], params: dict, salt: str | None = None, n: int = 6) -> list[int]:
    sp = hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, cache_salt=salt,
                             kv_transfer_params=params)
    return d.generate([prompt], sp, use_tqdm=False)[0].token_ids


def settle(*engines: hwkv.Engine, timeout_s: float = 10.0) -> None:
    """Step until no connector holds or loads anything (bounded)."""
    deadline = time.monotonic() + timeout_s
    while any(e.scheduler.connector.has_pending_transfers() or e.has_unfinished() for e in engines):
        assert time.monotonic() < deadline, "p2p transfers never settled"
        for e in engines:
            e.step()


def assert_clean(*engines: hwkv.Engine) -> None:
    settle(*engines)
    for e in engines:
        assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
        for m in getattr(e.kv_cache_manager, "managers", [e.kv_cache_manager]):  # KV-cache groups: each pool
            pool = m.block_pool
            assert pool.num_free_blocks == pool.num_usable_blocks
            assert all(b.ref_cnt == 0 for b in pool.blocks if b is not pool.null_block)
        assert not e.scheduler.delayed_free


def assert_round_trip(p: hwkv.Engine, d: hwkv.Engine, want: list[list[int]]) -> None:
    """Every prompt prefilled on ``p`` and decoded on ``d`` from its KV gives ``want``; every load
    was a hit (no failure, nothing recomputed), nothing is left pinned; both engines are closed."""
    try:
        got = [decode(d, q, prefill(p, q)) for q in prompts()]
        assert got == want
        st = d.stats()["kv_connector"]
        assert st["load_failures"] == 0 and st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts())
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


@pytest.fixture(params=["pull", "push", "push-staged"])
def pair(request, model_dir):
    mode, staged = request.param.split("-")[0], request.param.endswith("staged")
    # staged: through a host mirror of the pool, as tcp from a GPU does (here host to host)
    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("producer", mode, staging=staged))
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("consumer", mode, staging=staged))
    yield p, d
    p.close()
    d.close()


def test_decode_continues_from_remote_prefill_token_identical(pair, reference):
    p, d = pair
    got = []
    for prompt in prompts():
        params = prefill(p, prompt)
        assert params["remote_num_tokens"] == len(prompt)
        got.append(decode(d, prompt, params))
    assert got == reference
    st = d.stats()["kv_connector"]
    assert st["load_failures"] == 0 and st["failed_transfers"] == 0
    assert st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts())
    assert st["loaded_bytes"] > 0
    assert_clean(p, d)
    assert p.stats()["kv_connector"]["expired_holds"] == 0


def test_salted_requests_transfer_and_a_salt_mismatch_recomputes(pair, reference):
    p, d = pair
    prompt = prompts()[3]
    params = prefill(p, prompt, salt="tenant-a")
    assert decode(d, prompt, params, salt="tenant-a") == reference[3]
    params = prefill(p, prompt, salt="tenant-a")
    assert decode(d, prompt, params, salt="tenant-b") == reference[3]  # refused: recomputed
    st = d.stats()["kv_connector"]
    assert st["refused_offers"] == 1 and st["external_hit_tokens"] == len(prompt) - 1
    assert_clean(p, d)  # the refusing consumer released the producer's hold (no timeout needed)
    assert p.stats()["kv_connector"]["expired_holds"] == 0


def test_dead_producer_means_recompute_not_a_hang(model_dir, reference):
    for mode in ("pull", "push"):
        p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", mode))
        d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
                   kv_connector_config=cfg("consumer", mode, transfer_timeout_s=0.5))
        prompt = prompts()[4]
        params = prefill(p, prompt)
        p.close()  # side channel and transfer endpoint gone
        t0 = time.monotonic()
        assert decode(d, prompt, params) == reference[4]
        assert time.monotonic() - t0 < 5
        assert d.stats()["kv_connector"]["load_failures"] == 1
        assert_clean(d)
        d.close()


def test_unclaimed_blocks_are_freed_after_the_hold_timeout(model_dir):
    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("producer", "pull", hold_timeout_s=0.2))
    try:
        prefill(p, prompts()[4])
        assert p.kv_cache_manager.num_free_blocks < 16 and p.has_unfinished()
        assert_clean(p)  # steps until the hold expired
        assert p.stats()["kv_connector"]["expired_holds"] == 1
    finally:
        p.close()


def test_different_block_sizes_translate(model_dir, reference):
    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", "pull"))
    d = engine(model_dir, num_kv_blocks=32, block_size=BS // 2, kv_connector="p2p",
               kv_connector_config=cfg("consumer", "pull"))
    assert_round_trip(p, d, reference)


def test_bad_config_is_refused_naming_what_is_allowed(model_dir):
    with pytest.raises(ValueError, match="role='x' is invalid.*producer, consumer"):
        engine(model_dir, kv_connector="p2p", kv_connector_config={"role": "x"})
    with pytest.raises(ValueError, match="mode='pool' is invalid.*pull, push"):
        engine(model_dir, kv_connector="p2p", kv_connector_config={"role": "producer", "mode": "pool"})


def test_untranslatable_layout_is_refused_at_handshake_and_recomputed(model_dir, caplog):
    p = engine(model_dir, num_kv_blocks=16, dtype="float32", kv_connector="p2p",
               kv_connector_config=cfg("producer", "pull"))
    d = engine(model_dir, num_kv_blocks=16, dtype="bfloat16", kv_connector="p2p",
               kv_connector_config=cfg("consumer", "pull"))
    try:
        want = [o.token_ids for o in engine(model_dir, num_kv_blocks=16, dtype="bfloat16").generate(
            [prompts()[3]], greedy(6), use_tqdm=False)]
        with caplog.at_level("WARNING"):
            assert [decode(d, prompts()[3], prefill(p, prompts()[3]))] == want
        pid, did = p.scheduler.connector.worker.engine_id, d.scheduler.connector.worker.engine_id
        assert f"handshake with {p.scheduler.connector.worker.channel.address} refused: dtype differs: 'float32' at " \
            f"engine {pid}, 'bfloat16' at engine {did}" in caplog.text
        assert d.stats()["kv_connector"]["load_failures"] == 1
        p.scheduler.connector.scheduler.state.held.clear()  # never fetched: the hold would expire later
        p.scheduler.delayed_free.clear()
    finally:
        p.close()
        d.close()


def test_read_timing_out_mid_transfer_recomputes_and_keeps_blocks_pinned_a_while(model_dir, reference):
    """A pull read that times out after part of it landed (garbage here): the request recomputes
    with identical tokens, and its blocks stay pinned past the failure (a late write cannot land in
    reused blocks) until the grace period ends."""
    import ctypes

    from hwkv.interfaces.transfer import TransferTimeout

    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", "pull"))
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("consumer", "pull", transfer_timeout_s=0.3))
    conn = d.scheduler.connector
    real_read = conn.worker.transfer.read

    def torn_read(peer, local, remote, lengths):
        ctypes.memset(local[0], 0x7F, lengths[0])  # half-arrived bytes
        raise TransferTimeout("injected: read timed out mid-transfer")

    conn.worker.transfer.read = torn_read
    try:
        prompt = prompts()[4]
        assert decode(d, prompt, prefill(p, prompt)) == reference[4]
        assert d.stats()["kv_connector"]["load_failures"] == 1
        assert conn.scheduler._loads and d.kv_cache_manager.num_free_blocks < 16  # still pinned after the request ended
        conn.worker.transfer.read = real_read
        assert_clean(p, d)  # the grace period ends: every block comes back
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_small_consumer_pool_waits_and_preempts_with_identical_tokens(model_dir, mode):
    """Four remote-prefilled requests at once on a consumer of 10 blocks: some wait for blocks while
    others load, decodes preempt each other (a preempted request recomputes; it is not offered the
    remote KV again), and every request ends with one engine's tokens; nothing leaks."""
    import random

    rng = random.Random(3)
    batch = [[rng.randrange(1, 500) for _ in range(n)] for n in (40, 33, 47, 36)]
    want = [o.token_ids for o in engine(model_dir, num_kv_blocks=32).generate(batch, greedy(24), use_tqdm=False)]
    p = engine(model_dir, num_kv_blocks=32, kv_connector="p2p", kv_connector_config=cfg("producer", mode))
    d = engine(model_dir, num_kv_blocks=10, kv_connector="p2p", kv_connector_config=cfg("consumer", mode))
    try:
        params = [prefill(p, q) for q in batch]
        for i, (q, kv) in enumerate(zip(batch, params)):
            d.add_request(str(i), q, hwkv.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                         kv_transfer_params=kv))
        got: dict[str, list[int]] = {}
        deadline = time.monotonic() + 60
        while d.has_unfinished():
            assert time.monotonic() < deadline, "no progress"
            got.update((o.request_id, o.token_ids) for o in d.step() if o.finished)
        assert [got[str(i)] for i in range(len(batch))] == want
        st = d.stats()
        assert st["num_preemptions"] > 0 and st["kv_connector"]["load_failures"] == 0
        assert st["kv_connector"]["external_hit_tokens"] == sum(len(q) - 1 for q in batch)
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_consumer_that_fetches_nothing_releases_the_producers_blocks(model_dir):
    """A decode request aborted before admission, and one whose whole prompt is in the consumer's
    prefix cache, both tell the producer to free its blocks at once (not after hold_timeout_s)."""
    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("producer", "pull"))
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", kv_connector_config=cfg("consumer", "pull"))
    try:
        prompt = prompts()[2]  # 17 tokens: its first block holds all but the last one
        d.generate([prompt], greedy(2), use_tqdm=False)  # now in the consumer's prefix cache
        assert decode(d, prompt, prefill(p, prompt)) == d.generate([prompt], greedy(6), use_tqdm=False)[0].token_ids
        d.add_request("gone", prompt, hwkv.SamplingParams(max_tokens=4, kv_transfer_params=prefill(p, prompt)))
        d.abort(["gone"])
        assert_clean(p, d)
        st = p.stats()["kv_connector"]
        assert st["expired_holds"] == 0 and d.stats()["kv_connector"]["external_hit_tokens"] == 0
    finally:
        p.close()
        d.close()

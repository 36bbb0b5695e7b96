"""KV connectors on the backend: the global pool's round trip is exact.

One engine computes a prompt and puts its chunks into an in-process pool (the ``pool`` connector on
the embedded store: the backend's KV cache is read zero-copy when it is host memory, else through a
host staging cache filled by the backend's block copies and events); a second engine on the same
backend loads the shared prefix from the pool instead of computing it, and greedy tokens of both
agree with the reference as without the connector.
"""

from __future__ import annotations

import time

import pytest

from conformance.test_engine import generate, setup, tiny  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.capability("engine"), pytest.mark.timeout_s(600)]


def _settle(eng, timeout_s: float = 60.0) -> dict:
    conn, deadline = eng.scheduler.connector, time.monotonic() + timeout_s
    while conn.has_pending_transfers():
        assert time.monotonic() < deadline, "pool transfers did not complete"
        eng.step()
        time.sleep(0.005)
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache.spec.num_blocks, "pool pins leaked"
    return eng.stats()["kv_connector"]


def test_pool_round_trip_identity(engine_backend, check, setup):  # noqa: F811
    from hwkv import Engine
    from hwkv.connectors.pool.store import drop_embedded

    bs = setup.block_size
    prefix = setup.prompts([4 * bs], seed=11)[0]
    users = [prefix + tail for tail in setup.prompts([5, 3], seed=12)]
    cfg = {"store": "embedded", "store_name": "conformance-pool", "capacity_bytes": 256 << 20}
    engines = [Engine(setup.path, backend=engine_backend, dtype=setup.dtype, seed=0, num_kv_blocks=16,
                      max_model_len=8 * bs, max_num_seqs=4, kv_connector="pool", kv_connector_config=cfg)
               for _ in range(2)]
    try:
        got = [generate(engine_backend, setup, [users[0]], 4, engine=engines[0])[0][0]]
        first = _settle(engines[0])
        assert first["stored_chunks"] >= 4, f"the first engine must put the prompt's chunks: {first}"
        got.append(generate(engine_backend, setup, [users[1]], 4, engine=engines[1])[0][0])
        second = _settle(engines[1])
        assert second["external_hit_tokens"] == 4 * bs, f"the shared prefix must come from the pool: {second}"
        assert second["load_failures"] == 0, second
        for what, prompt, toks in zip(("engine that put", "engine that loaded"), users, got):
            setup.agree(check, [toks], [prompt], 4, f"pool connector, {what} vs reference")
    finally:
        for e in engines:
            e.scheduler.connector.shutdown()
        drop_embedded("conformance-pool")

"""KV connectors on the backend: the CPU offload connector's host tier round trip is exact.

A device pool too small to keep a reused prefix evicts it between requests; with the ``offload``
connector the prefix comes back from host memory (``Device.allocate_kv_cache(host=True)`` and the
backend's block copies), and greedy tokens agree with the reference as without the connector.
"""

from __future__ import annotations

import pytest

from conformance.test_engine import generate, setup, tiny  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.capability("engine"), pytest.mark.timeout_s(600)]


def test_offload_round_trip_identity(engine_backend, check, setup):  # noqa: F811
    bs = setup.block_size
    prefix = setup.prompts([4 * bs], seed=7)[0]
    users = [prefix + tail for tail in setup.prompts([5, 3], seed=8)]
    filler = setup.prompts([7 * bs + 2], seed=9)[0]  # with its 4 tokens it takes the whole pool
    from hwkv import Engine

    eng = Engine(setup.path, backend=engine_backend, dtype=setup.dtype, seed=0, num_kv_blocks=8,
                 max_model_len=8 * bs, max_num_seqs=8, kv_connector="offload",
                 kv_connector_config={"cpu_bytes": 64 << 20})
    got = []
    for prompt in (users[0], filler, users[1]):
        got.append(generate(engine_backend, setup, [prompt], 4, engine=eng)[0][0])
    stats = eng.stats()["kv_connector"]
    assert stats["external_hit_tokens"] == 4 * bs, f"the reused prefix must come from the host tier: {stats}"
    assert stats["load_failures"] == 0, stats
    for what, prompt, toks in zip(("first user", "filler", "user after a host-tier load"),
                                  (users[0], filler, users[1]), got):
        setup.agree(check, [toks], [prompt], 4, f"offload connector, {what} vs reference")

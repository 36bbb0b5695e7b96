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



def test_offload_preemption_identity(engine_backend, check, setup):  # noqa: F811
    """A preempted request's blocks are copied to the host tier before the step that reuses them
    writes into them (the copy is ordered ahead of that step's loads and forward on the backend's
    streams): the request comes back with its prefix loaded from the tier, and tokens agree."""
    bs = setup.block_size
    low, high = setup.prompts([4 * bs + 6, 6 * bs - 2], seed=10)
    from hwkv import Engine, SamplingParams

    eng = Engine(setup.path, backend=engine_backend, dtype=setup.dtype, seed=0, num_kv_blocks=8,
                 max_model_len=8 * bs, max_num_seqs=8, scheduling_policy="priority", kv_connector="offload",
                 kv_connector_config={"cpu_bytes": 64 << 20})
    want = {"low": 4, "high": 2 * bs}
    eng.add_request("low", low, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), priority=1)
    got: dict[str, list[int]] = {}
    for step in range(40 * bs):
        if step == 2:  # low holds 5 of the 8 blocks; high needs 6: low is displaced, and high's
            # prefill writes into low's freed blocks in that very step, then grows over the rest
            eng.add_request("high", high, SamplingParams(temperature=0.0, max_tokens=2 * bs, ignore_eos=True))
        elif step > 2 and not eng.has_unfinished():
            break
        got.update((o.request_id, list(o.token_ids)) for o in eng.step() if o.finished)
    assert {r: len(t) for r, t in got.items()} == want, f"every request must run to max_tokens: {got}"
    stats = eng.stats()
    conn = stats["kv_connector"]
    assert stats["num_preemptions"] > 0, f"the small pool must force preemption: {stats}"
    assert conn["preempted_store_blocks"] > 0 and conn["external_hit_tokens"] > 0, \
        f"the preempted request's prefix must come back from the host tier: {conn}"
    assert conn["load_failures"] == 0, conn
    for rid, prompt in (("low", low), ("high", high)):
        setup.agree(check, [got[rid]], [prompt], want[rid], f"offload connector with preemption, request {rid}")

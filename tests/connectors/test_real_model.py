"""The connector identity checks once on the real model (SmolLM2-135M-Instruct GGUF, float32 CPU):
KV that comes back from the host tier (offload), from another engine through the pool, and from a
prefill engine (P/D over p2p) gives exactly the tokens of one engine computing everything; nothing
stays pinned or held. The workloads and helpers are the tiny-model tests' own."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.connectors.pool.store import drop_embedded
from hwkv.testing.real_model import real_model_or_skip

from .conftest import BS, assert_no_leak, engine, run_one_by_one, workload

MB = 1 << 20


@pytest.fixture(scope="module")
def model():
    return str(real_model_or_skip())


@pytest.fixture(scope="module")
def reference(model):
    e = engine(model, dtype="float32")
    want = run_one_by_one(e, workload())
    assert e.stats()["prefix_cache_hits"] == 0  # the pool really is too small to keep the prefix
    return want


def test_offload_identity(model, reference):
    e = engine(model, dtype="float32", kv_connector="offload", kv_connector_config={"cpu_bytes": 32 * MB})
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert st["load_failures"] == 0 and st["external_hit_tokens"] == 2 * 4 * BS
    assert_no_leak(e)


def test_pool_identity(model, reference):
    from .test_pool import _close, _settle

    name = "test-real-model-pool"
    kw = dict(dtype="float32", kv_connector="pool", kv_connector_config={"store_name": name})
    a, b = engine(model, **kw), engine(model, **kw)
    try:
        prompts = workload()
        prefix_user = prompts[1]
        assert run_one_by_one(a, [prefix_user]) == [reference[1]]
        stored = _settle(a)["stored_bytes"]
        assert stored > 0
        assert run_one_by_one(b, [prefix_user]) == [reference[1]]
        sb = _settle(b)
        assert sb["external_hit_tokens"] >= 4 * BS and sb["loaded_bytes"] > 0 and sb["load_failures"] == 0
    finally:
        _close(a, b)
        drop_embedded(name)


def test_pd_identity(model):
    from hwkv.testing.mooncake import skip_unless_mooncake

    skip_unless_mooncake()
    from .test_p2p_engine import assert_round_trip, cfg, prompts

    ref = engine(model, dtype="float32", num_kv_blocks=16)
    want = [o.token_ids for o in ref.generate(prompts(), hwkv.SamplingParams(temperature=0, max_tokens=6,
                                                                              ignore_eos=True), use_tqdm=False)]
    kw = dict(dtype="float32", num_kv_blocks=16, kv_connector="p2p")
    p = engine(model, kv_connector_config=cfg("producer", "pull"), **kw)
    d = engine(model, kv_connector_config=cfg("consumer", "pull"), **kw)
    assert_round_trip(p, d, want)

"""Engine options resolve once into grouped configs (model, cache, scheduler, parallel, runtime,
kv_transfer); defaults computed there, errors name the field."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.engine import EngineArgs, EngineConfig
from hwkv.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("cfg") / "m", arch="llama", max_position_embeddings=256))


def test_defaults_resolved_once_into_groups(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=40)
    c = e.config
    assert isinstance(c, EngineConfig)
    assert (c.model.model, c.model.max_model_len, c.model.seed) == (model_dir, 256, 0)
    assert (c.cache.block_size, c.cache.num_kv_blocks, c.cache.enable_prefix_caching) == (16, 40, True)
    assert (c.scheduler.max_num_batched_tokens, c.scheduler.max_model_len, c.scheduler.max_num_seqs) == (2048, 256, 256)
    assert not c.runtime.graphs and c.runtime.graph_max_batch == 0 and not c.runtime.async_scheduling
    assert not c.runtime.fuse_elementwise and c.kv_transfer is None and c.speculative is None
    assert c.parallel.tensor_parallel_size == 1
    assert e.kv_cache.spec.num_blocks == 40 and e.scheduler.config is c.scheduler and e.block_size == 16


def test_pool_caps_max_model_len_and_budget_follows_chunking(model_dir):
    c = hwkv.Engine(model_dir, num_kv_blocks=4, block_size=8).config
    assert c.model.max_model_len == 32 == c.scheduler.max_model_len  # 4 blocks of 8 tokens
    c = hwkv.Engine(model_dir, num_kv_blocks=40, enable_chunked_prefill=False).config
    assert c.scheduler.max_num_batched_tokens == 2048  # max(2048, max_model_len 256)


def test_connector_resolves_into_kv_transfer(model_dir):
    from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

    class Acting(KVConnectorBase):
        pass

    conn = Acting()
    e = hwkv.Engine(model_dir, num_kv_blocks=16, kv_connector=conn)
    assert e.config.kv_transfer.kv_connector is conn and e.connector is conn and e.scheduler.connector is conn
    assert e.runner.connector is conn
    assert hwkv.Engine(model_dir, num_kv_blocks=16, kv_connector=NoOpConnector()).config.kv_transfer is None


@pytest.mark.parametrize("kw, match", [
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be a bool, got 'yes'"),
    (dict(max_num_seqs=True), "max_num_seqs must be an int >= 1, got True"),
    (dict(block_size=0), r"block_size must be None or an int >= 1, got 0"),
    (dict(decode_ops=1), "decode_ops must be None or a bool, got 1"),
])
def test_args_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="m", **kw)


def test_benchmark_knobs_are_not_engine_options(model_dir):
    with pytest.raises(TypeError, match="prefetch_weights"):
        hwkv.Engine(model_dir, num_kv_blocks=16, prefetch_weights=False)
    assert not hasattr(hwkv.Engine(model_dir, num_kv_blocks=16).model, "decode_read_bytes")

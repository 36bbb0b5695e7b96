"""Engine options resolve once into grouped configs (model, cache, scheduler, parallel, runtime,
kv_transfer); defaults computed there, errors name the field."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.engine import EngineArgs, EngineConfig
from hwkv.model.tiny import write_tiny_model


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
    (dict(max_num_seqs=True), "max_num_seqs must be None or an int >= 1, got True"),
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


class _Dev:
    """A device stub for the defaults table: an accelerator (own memory: async copies) or the host."""

    def __init__(self, kind: str, total_gib: float):
        self.async_copies, self._total = kind != "cpu", int(total_gib * 2**30)

    def memory_info(self):
        return self._total // 2, self._total


def test_scheduler_defaults_follow_device_and_entry_point():
    from hwkv.engine.defaults import scheduler_defaults

    h100, l4 = _Dev("cuda", 79.2), _Dev("cuda", 22)
    assert scheduler_defaults(h100, None)[:2] == (16384, 1024)  # offline on a >= 70 GiB GPU (vLLM's LLM class)
    assert scheduler_defaults(h100, "server")[:2] == (8192, 1024)
    assert scheduler_defaults(l4, "offline")[:2] == (8192, 256)
    assert scheduler_defaults(l4, "server")[:2] == (2048, 256)
    assert scheduler_defaults(_Dev("cpu", 512), "server")[:2] == (2048, 256)  # the host keeps small ones
    with pytest.raises(ValueError, match=r"usage_context must be one of \['offline', 'server'\]"):
        scheduler_defaults(h100, "batch")


def test_defaults_resolve_from_the_backend_device_and_stay_overridable(model_dir, monkeypatch):
    from hwkv.reference.device import CpuDevice

    c = hwkv.Engine(model_dir, num_kv_blocks=40).config  # the CPU reference: the host row
    assert (c.scheduler.max_num_batched_tokens, c.scheduler.max_num_seqs) == (2048, 256)
    # a device that reports itself as a big accelerator gets the offline / server rows
    big = _Dev("cuda", 80)
    monkeypatch.setattr(CpuDevice, "async_copies", True)
    monkeypatch.setattr(CpuDevice, "memory_info", lambda self: big.memory_info())
    from hwkv.engine import EngineArgs as Args

    a = Args(model=model_dir).with_device_defaults(CpuDevice())
    assert (a.max_num_batched_tokens, a.max_num_seqs) == (16384, 1024)
    a = Args(model=model_dir, usage_context="server", max_num_seqs=8).with_device_defaults(CpuDevice())
    assert (a.max_num_batched_tokens, a.max_num_seqs) == (8192, 8)  # an explicit value is kept
    a = Args(model=model_dir, enable_chunked_prefill=False).with_device_defaults(CpuDevice())
    assert a.max_num_batched_tokens is None  # without chunking resolve raises it to max_model_len
    with pytest.raises(ValueError, match="usage_context must be None or one of"):
        Args(model=model_dir, usage_context="online")

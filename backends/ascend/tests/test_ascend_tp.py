"""Tensor parallelism on the Ascend backend through the emulator: the generic torch.distributed
communicator with ``dist_backend="hccl"`` (the emulated torch_npu registers ``hccl`` over gloo, as
the real one registers HCCL), worker processes importing the emulator through a ``torch_npu`` shim;
tp=2 gives the tp=1 greedy tokens. (Emulation on the CPU: no claim about HCCL on hardware.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import hwkv
from hwkv.model import tiny

pytestmark = pytest.mark.timeout(240)

SHIM = '''import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("hwkv_ascend_tests_npu_emulator", os.environ["HWKV_NPU_EMULATOR"])
emu = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = emu
spec.loader.exec_module(emu)
sys.modules["torch_npu"] = emu.make_module()
'''


def test_hccl_communicator_wiring(npu):
    import torch.distributed as dist
    from hwkv_ascend.device import AscendDevice

    from hwkv.parallel.communicator import TorchDistCommunicator, open_store

    dev = AscendDevice(0)
    assert dev.dist_backend == "hccl"
    store = open_store(1, 30.0)
    comm = TorchDistCommunicator(dev, 0, 1, store.port, 30.0, store=store)
    try:
        assert comm.backend_name == "hccl" and not dist.is_initialized()  # its own group, not the default
        assert comm.all_reduce(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]
        assert comm.all_reduce_min(7) == 7
    finally:
        comm.close()
    assert not dist.is_initialized()


def test_tp2_on_ascend_gives_the_tp1_tokens(npu, tmp_path, monkeypatch):
    shim = tmp_path / "site" / "torch_npu"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(SHIM)
    monkeypatch.setenv("HWKV_NPU_EMULATOR", str(Path(__file__).resolve().parent / "npu_emulator.py"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim.parent), *sys.path]))
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    path = tiny.write_tiny_model(tmp_path / "m", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                                 num_layers=2, vocab_size=512, tokenizer=False)
    prompts = [[5, 6, 7, 8, 9], list(range(30, 70)), [7] * 20]
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(backend="ascend", dtype=torch.float16, block_size=128, num_kv_blocks=6, max_model_len=256)

    def tokens(e):
        return [list(o.token_ids) for o in e.generate(prompts, params, use_tqdm=False)]

    ref = tokens(hwkv.Engine(str(path), **kw))
    eng = hwkv.Engine(str(path), tensor_parallel_size=2, **kw)
    try:
        assert eng.model.config.num_kv_heads == 1  # this rank holds half the KV heads
        assert tokens(eng) == ref
        assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.block_pool.num_blocks
    finally:
        eng.close()

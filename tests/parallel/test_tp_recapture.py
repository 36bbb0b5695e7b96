"""hwkv.engine.tp.runner.recapture (bench A/B runs of kernel variants in one engine) and its message."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

import hwkv
from hwkv.engine.tp import messages as m
from hwkv.engine.tp.runner import recapture
from hwkv.model.tiny import write_tiny_model
from hwkv.reference.graphs import GraphCpuBackend
from hwkv.sampling_params import SamplingParams


def test_recapture_message_round_trip():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.ToWorker)
    msg = dec.decode(enc.encode(m.Recapture({"HWKV_X": "1", "HWKV_Y": ""}, 0, 1)))
    assert msg == m.Recapture({"HWKV_X": "1", "HWKV_Y": ""}, 0, 1)


def test_recapture_sets_env_and_captures_only_the_batch_asked(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    mdir = str(write_tiny_model(tmp_path / "llama", arch="llama", max_position_embeddings=256))
    e = hwkv.Engine(mdir, backend=GraphCpuBackend(), num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64,
                    max_num_seqs=4, fuse_elementwise=False)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [[5, 9, 33, 2, 71]]
    want = e.generate(prompt, sp, use_tqdm=False)[0].token_ids
    sets = [g for g in (e.runner.graphs, e.runner.graphs_b) if g is not None]
    before = {id(g): dict(g.graphs) for g in sets}
    monkeypatch.setenv("HWKV_TEST_UNSET_ME", "1")
    n = recapture(e.runner, 0, 1, {"HWKV_TEST_TILE": "a=1", "HWKV_TEST_UNSET_ME": ""})
    assert os.environ["HWKV_TEST_TILE"] == "a=1" and "HWKV_TEST_UNSET_ME" not in os.environ
    monkeypatch.delenv("HWKV_TEST_TILE")
    ones = [k for g in sets for k in g.graphs if k[0] == 1]
    assert n == len(ones) > 0
    for g in sets:  # batch-1 graphs new, the rest untouched
        for k, v in g.graphs.items():
            assert (v is before[id(g)][k]) == (k[0] != 1)
    assert e.generate(prompt, sp, use_tqdm=False)[0].token_ids == want  # the new graphs replay the same tokens
    with pytest.raises(ValueError, match="HWKV_"):
        recapture(e.runner, 0, 1, {"PATH": "/x"})
    e.close()


def test_recapture_at_tp2_reaches_the_worker_and_keeps_the_tokens(tmp_path):
    """The driver's recapture goes to the worker in the call stream; the steps after it run as before (gloo, no
    graphs on the CPU backend: nothing to capture, the message path and the env check only)."""
    path = write_tiny_model(tmp_path, arch="llama", tokenizer=False)
    e = hwkv.Engine(str(path), tensor_parallel_size=2, block_size=16, num_kv_blocks=32, max_model_len=128)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        want = e.generate([[5, 9, 33, 2]], sp, use_tqdm=False)[0].token_ids
        assert e.runner.recapture(0, 1, {"HWKV_TEST_TILE": "b=2"}) == 0
        assert os.environ.pop("HWKV_TEST_TILE") == "b=2"
        assert e.generate([[5, 9, 33, 2]], sp, use_tqdm=False)[0].token_ids == want
        with pytest.raises(ValueError, match="HWKV_"):  # refused on the driver before it is sent
            e.runner.recapture(0, 1, {"LD_PRELOAD": "x"})
        assert e.generate([[5, 9, 33, 2]], sp, use_tqdm=False)[0].token_ids == want  # the worker is still there
    finally:
        e.close()

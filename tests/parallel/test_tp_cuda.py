"""Tensor parallelism on CUDA (NCCL): tp=2 with graphs gives the tp=1 greedy tokens. Needs two GPUs
(skipped with fewer) and the CUDA plugin registered (``HWKV_PLUGIN_MODULES=hwkv_cuda.plugin``)."""

from __future__ import annotations

import pytest
import torch

from hwkv.engine import Engine
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 CUDA GPUs")]


def _cuda() -> None:
    from hwkv.plugins import get_backend

    try:
        get_backend("cuda")
    except Exception as e:
        pytest.skip(f"cuda backend unavailable: {e}")


@pytest.mark.parametrize("kv", [2, 1])
@pytest.mark.parametrize("eager", [True, False])
def test_tp2_cuda_tokens_equal_tp1(tmp_path, kv, eager):
    _cuda()
    path = str(write_tiny_model(tmp_path, hidden_size=256, num_heads=8, num_kv_heads=kv, vocab_size=1000,
                                tokenizer=False))
    prompts = [[5 + i, 6, 7, 8 * i + 1] * (i + 1) for i in range(12)]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    kw = {"backend": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 256, "max_model_len": 256,
          "enforce_eager": eager}
    one = Engine(path, **kw)
    ref = [o.token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    del one
    torch.cuda.empty_cache()
    eng = Engine(path, tensor_parallel_size=2, **kw)
    try:
        got = [o.token_ids for o in eng.generate(prompts, sp, use_tqdm=False)]
        assert got == ref
        if not eager:
            assert eng.runner.num_graph_steps > 0  # decode steps replayed graphs with NCCL all-reduces inside
    finally:
        eng.close()


def test_tp2_cuda_engines_in_a_loop_use_the_custom_all_reduce(tmp_path, monkeypatch):
    """Two tp=2 engines one after the other in one process (the first dropped by rebinding), each
    in its own group with the custom all-reduce (peer memory) inside its graphs: the tp=1 tokens,
    bf16 decode through the fused decode ops (all_reduce_add) included."""
    _cuda()
    monkeypatch.setenv("HWKV_CUSTOM_ALLREDUCE", "auto")  # the default, pinned (inherited by the workers)
    path = str(write_tiny_model(tmp_path, hidden_size=256, num_heads=8, num_kv_heads=2, vocab_size=1000,
                                tokenizer=False))
    prompts = [[5 + i, 6, 7, 8 * i + 1] * (i + 1) for i in range(6)]
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    kw = {"backend": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 128, "max_model_len": 256}
    one = Engine(path, **kw)
    ref = [o.token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    one.close()
    del one
    torch.cuda.empty_cache()
    eng = None
    for _ in range(2):
        eng = Engine(path, tensor_parallel_size=2, **kw)
        assert eng._tp.comm._custom is not None
        assert [o.token_ids for o in eng.generate(prompts, sp, use_tqdm=False)] == ref
        assert eng.runner.num_graph_steps > 0
    eng.close()


def test_tp2_cuda_all_reduce_in_the_gemvs_same_tokens_as_the_push_kernel(tmp_path, monkeypatch):
    """The row-parallel all-reduce inside the decode GEMVs (HWKV_TP_FUSED_AR=1) against the push kernel
    (=0): each prompt generated alone (one-token forwards: the path the fused ops take), bf16, the same
    sums in the same order - the same tokens; the path was set up (self-test passed) and no wait gave up."""
    _cuda()
    path = str(write_tiny_model(tmp_path, hidden_size=256, num_heads=8, num_kv_heads=2, vocab_size=1000,
                                tokenizer=False))
    prompts = [[5 + i, 6, 7, 8 * i + 1] * (i + 1) for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    kw = {"backend": "cuda", "dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 128, "max_model_len": 256}
    got = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("HWKV_TP_FUSED_AR", fused)  # read at setup, inherited by the workers
        eng = Engine(path, tensor_parallel_size=2, **kw)
        try:
            ar = eng._tp.comm._custom
            assert ar is not None and ar.fused == (fused == "1"), getattr(ar, "fused_error", "")
            got[fused] = [eng.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
            assert eng.runner.num_graph_steps > 0 and not ar.failed()
        finally:
            eng.close()
    assert got["1"] == got["0"]


def test_tp2_cuda_graph_sampling_tokens_equal_tp1(tmp_path, monkeypatch):
    """The greedy argmax inside the decode graphs at tp=2 (HWKV_TP_GRAPH_SAMPLE=1, read at start-up and inherited by
    the worker): every rank takes the graph's tokens on plain greedy steps (both graph sets), the tp=1 tokens; seeded
    sampling beside still samples on the driver and broadcasts, the tp=1 tokens too."""
    _cuda()
    path = str(write_tiny_model(tmp_path, hidden_size=256, num_heads=8, num_kv_heads=2, vocab_size=1000,
                                tokenizer=False))
    prompts = [[5 + i, 6, 7, 8 * i + 1] * (i + 1) for i in range(6)]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, seed=i) for i in range(len(prompts))]
    kw = {"backend": "cuda", "dtype": "float32", "block_size": 16, "num_kv_blocks": 256, "max_model_len": 256}
    one = Engine(path, **kw)
    ref = [o.token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    ref_alone = one.generate(prompts[:1], greedy, use_tqdm=False)[0].token_ids
    ref_seeded = [o.token_ids for o in one.generate(prompts, seeded, use_tqdm=False)]
    one.close()
    del one
    torch.cuda.empty_cache()
    monkeypatch.setenv("HWKV_TP_GRAPH_SAMPLE", "1")
    eng = Engine(path, tensor_parallel_size=2, **kw)
    try:
        assert eng.runner.graphs_b is not None  # the second set of sampling graphs, as at one device
        assert [o.token_ids for o in eng.generate(prompts, greedy, use_tqdm=False)] == ref
        assert eng.generate(prompts[:1], greedy, use_tqdm=False)[0].token_ids == ref_alone
        assert eng.runner.num_graph_sampled_steps > 0
        assert [o.token_ids for o in eng.generate(prompts, seeded, use_tqdm=False)] == ref_seeded
    finally:
        eng.close()


def test_tp2_cuda_low_latency_push_same_tokens_as_the_push_kernel(tmp_path, monkeypatch):
    """The low-latency push (HWKV_PUSH_LL=1: the epoch in every word, no flag round) and all-gather of the logits
    (HWKV_PUSH_GATHER=1) against the push kernel and NCCL's gather (=0, set up but not taken): each prompt generated
    alone, bf16, the same sums - the same tokens; it passed its setup self-test and no wait gave up."""
    _cuda()
    path = str(write_tiny_model(tmp_path, hidden_size=256, num_heads=8, num_kv_heads=2, vocab_size=1000,
                                tokenizer=False))
    prompts = [[5 + i, 6, 7, 8 * i + 1] * (i + 1) for i in range(4)]
    sp = SamplingParams(max_tokens=24, temperature=0.0)
    kw = {"backend": "cuda", "dtype": "bfloat16", "block_size": 16, "num_kv_blocks": 128, "max_model_len": 256}
    got = {}
    for ll in ("0", "1"):
        monkeypatch.setenv("HWKV_PUSH_LL", ll)  # set: set up at start-up; "1": taken
        monkeypatch.setenv("HWKV_PUSH_GATHER", ll)  # the logits' low-latency all-gather beside it
        eng = Engine(path, tensor_parallel_size=2, **kw)
        try:
            ar = eng._tp.comm._custom
            assert ar is not None and ar.ll_max > 0, getattr(ar, "ll_error", "")
            got[ll] = [eng.generate([p], sp, use_tqdm=False)[0].token_ids for p in prompts]
            assert eng.runner.num_graph_steps > 0 and not ar.failed()
        finally:
            eng.close()
    assert got["1"] == got["0"]

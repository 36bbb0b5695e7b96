"""Decode fast path: buckets, padding, the static-buffer path (CPU, no capture) and, on a GPU,
greedy outputs with CUDA graphs identical to eager."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import hwkv
from hwkv.engine.graph_runner import batch_buckets, pad_into, pick_bucket
from hwkv.engine.inputs import StepBatch
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams
from hwkv.testing.cuda import cuda_backend_or_skip


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(256)[-3:] == [224, 240, 256]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    b = batch_buckets(40)
    assert [pick_bucket(b, n) for n in (1, 3, 8, 9, 17, 33, 40, 41)] == [1, 4, 8, 16, 32, 40, 40, None]


def test_seq_buckets_and_keys():
    from types import SimpleNamespace

    from hwkv.engine.graph_runner import SMALL_BATCH, GraphRunner, seq_buckets

    assert seq_buckets(4096) == [512, 1024, 2048, 4096]
    assert seq_buckets(3000) == [512, 1024, 2048, 3000]
    assert seq_buckets(300) == [300]
    g = SimpleNamespace(buckets=batch_buckets(32), seq_buckets=seq_buckets(4096), max_model_len=4096)
    keys = GraphRunner.keys(g)
    assert (1, 512) in keys and (8, 4096) in keys and (16, 4096) in keys and (16, 512) not in keys
    assert len(keys) == 4 * 4 + 2 and SMALL_BATCH == 8
    key = lambda n, s: GraphRunner.key(g, n, s)  # noqa: E731
    assert [key(1, 100), key(3, 513), key(8, 4096), key(9, 10), key(33, 1)] == \
        [(1, 512), (4, 1024), (8, 4096), (16, 4096), None]
    g.key, g.graphs = key, {(4, 1024): ("graph of (4, 1024)", None, None)}
    assert [GraphRunner.graph(g, 3, 513), GraphRunner.graph(g, 3, 100), GraphRunner.graph(g, 33, 1)] == \
        ["graph of (4, 1024)", None, None]


def test_pad_into():
    n, bucket, mb, w = 3, 4, 6, 5
    batch = StepBatch(np.array([7, 8, 9]), np.array([10, 20, 30]), np.array([40, 81, 122]),
                      np.arange(4, dtype=np.int32), np.array([11, 21, 31], dtype=np.int32),
                      np.arange(6, dtype=np.int32).reshape(3, 2) + 1, np.arange(3), np.arange(3), 3, 1)
    assert batch.pure_decode
    i64, seq = np.full((3, mb), 99, np.int64), np.full(mb, 99, np.int32)
    bt = np.full((mb, w), 99, np.int32)
    pad_into(batch, bucket, i64, seq, bt)
    assert i64[:, :bucket].tolist() == [[7, 8, 9, 0], [10, 20, 30, 0], [40, 81, 122, -1]]
    assert (i64[:, bucket:] == 99).all() and (seq[bucket:] == 99).all()  # rows past the bucket untouched
    assert seq[:bucket].tolist() == [11, 21, 31, 1]
    assert bt[:n, :2].tolist() == [[1, 2], [3, 4], [5, 6]] and bt[n, 0] == 0
    with pytest.raises(ValueError, match="does not fit bucket"):
        pad_into(batch, 2, i64, seq, bt)
    with pytest.raises(ValueError, match="block table width"):
        pad_into(batch._replace(block_tables=np.zeros((3, w + 1), np.int32)), bucket, i64, seq, bt)


@pytest.fixture
def fresh_dynamo():
    """Dynamo keeps 8 compiled variants per function per process; tests compiling the fused ops for
    several dtypes/devices/backends would exceed that, and a variant past the limit runs uncompiled
    (bf16 results then differ in the last bits between paths). Each such test starts clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("cg") / "llama", arch="llama", max_position_embeddings=256))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(9)]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(2, 30))]
            for i in range(n)]


def _greedy(n: int) -> list[SamplingParams]:
    # different lengths: the decode batch shrinks through several buckets and non-bucket sizes
    return [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(n)]


def test_static_buffer_path_matches_eager_cpu(model_dir):
    """The padded static-buffer decode path (run eagerly on CPU) gives the eager path's tokens;
    batches above the largest bucket fall back to eager; nothing leaks."""
    torch.set_num_threads(1)
    prompts, params = _prompts(11), _greedy(11)
    kw = dict(num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16)
    ref = hwkv.Engine(model_dir, **kw)
    assert ref.runner.graphs is None  # the CPU backend cannot capture graphs
    want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    e = hwkv.Engine(model_dir, **kw)
    e.runner.enable_graphs(max_batch=6, use_graphs=False)  # 1, 2, 4, 6: 7..11 running decodes go eager
    got = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert e.runner.num_graph_steps > 10
    assert e.kv_cache_manager.num_free_blocks == 64 and not e.runner.reqs


def test_sampled_and_seeded_requests_on_static_path(model_dir):
    """Seeded sampling on the static path draws the same tokens as eager (per-request generators)."""
    torch.set_num_threads(1)
    prompts = _prompts(5, seed=1)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=6, ignore_eos=True) for i in range(5)]
    kw = dict(num_kv_blocks=48, max_model_len=128, max_num_batched_tokens=64)
    want = [o.token_ids for o in hwkv.Engine(model_dir, **kw).generate(prompts, params, use_tqdm=False)]
    e = hwkv.Engine(model_dir, **kw)
    e.runner.enable_graphs(max_batch=8, use_graphs=False)
    assert [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)] == want
    assert e.runner.num_graph_steps > 0


def test_enforce_eager_validated(model_dir):
    with pytest.raises(ValueError, match="enforce_eager"):
        hwkv.Engine(model_dir, num_kv_blocks=16, enforce_eager="yes")
    with pytest.raises(ValueError, match="fuse_elementwise"):
        hwkv.Engine(model_dir, num_kv_blocks=16, fuse_elementwise=1)


def _cuda_backend():
    return cuda_backend_or_skip()


@pytest.mark.parametrize("fuse", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_greedy_identical_to_eager(model_dir, dtype, fuse, fresh_dynamo):
    """Same model functions on both sides (fused elementwise ops or not); only the step path differs."""
    backend = _cuda_backend()
    prompts, params = _prompts(11), _greedy(11)
    kw = dict(dtype=dtype, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16,
              fuse_elementwise=fuse)
    eager = hwkv.Engine(model_dir, backend=backend, enforce_eager=True, **kw)
    assert eager.runner.graphs is None
    want = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    g = hwkv.Engine(model_dir, backend=backend, **kw)
    assert g.runner.graphs is not None and sorted({b for b, _ in g.runner.graphs.graphs}) == [1, 2, 4, 8, 16]
    assert g.async_scheduling and not eager.async_scheduling  # graphs + async vs the synchronous eager path
    got = [o.token_ids for o in g.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert g.runner.num_graph_steps > 10
    assert g.kv_cache_manager.num_free_blocks == 64 and not g.runner.reqs

def test_prefetch_weights_same_tokens_on_gpu(model_dir):
    backend = _cuda_backend()
    prompts, params = _prompts(6), _greedy(6)
    kw = dict(dtype="bfloat16", num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=8,
              fuse_elementwise=False)
    want = [o.token_ids for o in hwkv.Engine(model_dir, backend=backend, **kw).generate(prompts, params,
                                                                                        use_tqdm=False)]
    from hwkv.bench.common import enable_weight_prefetch

    e = hwkv.Engine(model_dir, backend=backend, **kw)
    enable_weight_prefetch(e)  # graphs recaptured with the prefetch hints inside
    assert e.model._prefetch is not None and e.runner.graphs.graphs
    assert [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)] == want


def test_fuse_elementwise_same_tokens(model_dir, fresh_dynamo):
    """The fused RMSNorm / RoPE / SiLU·mul replacements compute the model's functions (checked
    through torch.compile's eager backend: no compiler needed on CPU)."""
    from hwkv.model.fuse import fuse_elementwise

    torch.set_num_threads(1)
    prompts, params = _prompts(4, seed=2), _greedy(4)
    kw = dict(num_kv_blocks=48, max_model_len=128, max_num_batched_tokens=64)
    want = [o.token_ids for o in hwkv.Engine(model_dir, **kw).generate(prompts, params, use_tqdm=False)]
    e = hwkv.Engine(model_dir, **kw)
    assert fuse_elementwise(e.model, backend="eager") == 2 * 2 + 1 + 1 + 2  # norms, final norm, rope, MLPs
    assert [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)] == want


def test_bench_e2e_smoke_cpu(model_dir, tmp_path):
    """`hwkv bench e2e` end to end on the CPU reference backend (tiny workload, no HF peer)."""
    import argparse
    import json

    from hwkv.bench import e2e

    torch.set_num_threads(1)
    ap = argparse.ArgumentParser()
    e2e.add_arguments(ap)
    args = ap.parse_args(["--model", model_dir, "--backend", "cpu", "--dtype", "float32", "--num-requests", "6",
                          "--min-len", "4", "--max-len", "12", "--b1-tokens", "8", "--prefix-requests", "3",
                          "--prefix-len", "32", "--parts", "a,b,c,p,r", "--no-hf",
                          "--roofline-requests", "3", "--roofline-in", "8", "--roofline-out", "4",
                          "--out-dir", str(tmp_path),
                          "--b1-variants", json.dumps([dict(label="async on", engine=dict(async_scheduling=True))]),
                          "--engine-args", json.dumps(dict(max_model_len=256, max_num_seqs=4,
                                                           max_num_batched_tokens=128))])
    assert e2e.run(args) == 0
    res = json.loads(next(tmp_path.glob("e2e-*.json")).read_text())
    assert not res["errors"]
    assert res["throughput"]["hwkv"]["output_tokens"] == sum(m for _, m in e2e.workload(6, 4, 12, 512))
    assert res["batch1"]["tok_per_s"] > 0 and res["batch1"]["eager"]["tok_per_s"] > 0
    assert res["batch1_variants"]["async on"]["tok_per_s"] > 0
    assert res["shared_prefix"]["stats_on"]["prefix_cache_hits"] > 0 == res["shared_prefix"]["stats_off"][
        "prefix_cache_hits"]
    assert "step_wall" in res["profile"]["batch 1"]
    r = res["roofline"]
    assert r["hwkv"]["output_tokens"] == 3 * 4 and r["roofline"]["decode_steps"] == 3
    assert 0 < r["roofline"]["prefill_s"] < r["roofline"]["seconds"] and r["efficiency"] > 0
    assert (tmp_path / next(tmp_path.glob("e2e-*.md")).name).read_text().startswith("# hwkv bench e2e")

"""On a GPU (skipped elsewhere): short-query steps (prompt tails after a prefix-cache hit, alone, batched
and beside running decodes) replay CUDA graphs and give float32 greedy tokens identical to the eager
engine's; decode steps keep their own graphs; nothing leaks."""

from __future__ import annotations

import numpy as np

import hwkv
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams
from hwkv.testing.cuda import cuda_backend_or_skip


def _cuda_backend():
    return cuda_backend_or_skip()


def test_cuda_tail_graphs_greedy_identical(tmp_path):
    backend = _cuda_backend()
    model = str(write_tiny_model(tmp_path / "m", num_layers=4, max_position_embeddings=1024))
    rng = np.random.default_rng(0)
    base = rng.integers(3, 500, 400).tolist()  # 25 blocks of 16
    tails = [base + rng.integers(3, 500, n).tolist() for n in (2, 7, 16, 17, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(**extra):
        e = hwkv.Engine(model, backend=backend, dtype="float32", num_kv_blocks=256, block_size=16,
                        max_model_len=512, max_num_seqs=8, fuse_elementwise=False, **extra)
        e.generate([base], greedy, use_tqdm=False)
        out = [e.generate([p], greedy, use_tqdm=False)[0].token_ids for p in tails]
        out += [o.token_ids for o in e.generate(tails, greedy, use_tqdm=False)]
        e.add_request("a", tails[4], long)  # decoding while the others' tails arrive
        for i in range(400):
            if i in (3, 6):
                e.add_request(f"t{i}", tails[i // 3 - 1], greedy)
            out += [o.token_ids for o in e.step() if o.finished]
            if not e.has_unfinished():
                break
        assert e.kv_cache_manager.num_free_blocks == 256 and not e.runner.reqs
        return out, e

    want, _ = run(enforce_eager=True)
    got, e = run()
    assert e.runner.tail_graphs is not None and e.runner.tail_graphs.graphs
    assert got == want
    assert e.runner.num_tail_graph_steps >= 4 and e.runner.num_graph_steps > 0

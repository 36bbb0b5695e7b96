"""On a GPU (skipped elsewhere): speculative decoding with CUDA verify graphs gives float32 greedy tokens
identical to eager speculation and to non-speculative decoding, and verify steps replay graphs (EAGLE:
graphs that also return the target's states)."""

from __future__ import annotations

import pytest

from hwkv.engine.engine import Engine
from hwkv.sampling_params import SamplingParams
from hwkv.testing.cuda import cuda_backend_or_skip

from .test_engine_ngram import _prompts


def _cuda_backend():
    return cuda_backend_or_skip()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_cuda_verify_graphs_greedy_identical(tiny_model: str, tiny_eagle: str, tmp_path, method: str) -> None:
    from .conftest import write_tiny_eagle3

    backend = _cuda_backend()
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        model = {"draft_model": tiny_model, "eagle": tiny_eagle}.get(method) or write_tiny_eagle3(tmp_path / "e3")
        spec = {"method": method, "num_speculative_tokens": 3, "model": model}
    prompts = _prompts(7, seed=31)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(backend=backend, dtype="float32", num_kv_blocks=96, block_size=16, max_model_len=128,
              max_num_seqs=8, fuse_elementwise=False)

    def run(**extra):
        e = Engine(tiny_model, **kw, **extra)
        out = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
        assert e.kv_cache_manager.num_free_blocks == 96 and not e.runner.reqs
        return out, e

    base, _ = run(enforce_eager=True)
    eager, _ = run(enforce_eager=True, speculative_config=spec)
    got, e = run(speculative_config=spec)
    assert e.runner.verify_graphs is not None and e.runner.verify_graphs.graphs
    assert got == eager == base
    steps = e.stats()["spec_decode"]["verify_graph_steps"]
    assert steps > 0 and steps == e.runner.num_verify_graph_steps

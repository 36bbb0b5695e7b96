"""Several tensor-parallel engines in one process (gloo, CPU): created and dropped in any order,
two alive at once, each in its own process group; a dropped engine's workers exit within seconds,
and every engine gives the tp=1 greedy tokens."""

from __future__ import annotations

import gc

import pytest

from hwkv.engine import Engine
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams
from tests.parallel.test_tp_engine import _gone

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5, 6, 7, 8, 9], list(range(30, 50))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
KW = {"block_size": 16, "num_kv_blocks": 16, "max_model_len": 64}


def _tokens(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_engines_created_and_dropped_in_any_order(tmp_path):
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, vocab_size=256, tokenizer=False))
    ref = _tokens(Engine(path, **KW))
    # the same variable rebound in a loop: the previous engine is dropped, never closed by hand
    pids: list[int] = []
    e = None
    for _ in range(2):
        e = Engine(path, tensor_parallel_size=2, **KW)
        assert _tokens(e) == ref
        pids += [p.pid for p in e._tp.procs]
    first = pids[:1]
    assert _gone(first, within=10.0)  # the first engine was dropped when e was rebound
    # two alive at once, closed in the order they were built, then the other way round
    a = Engine(path, tensor_parallel_size=2, **KW)
    assert a._tp.comm.group_name != e._tp.comm.group_name
    assert _tokens(a) == ref and _tokens(e) == ref
    e.close()
    assert _gone(pids, within=10.0)
    assert _tokens(a) == ref  # closing one engine leaves the other's group working
    hits = a.stats()["prefix_cache_hits"]
    assert _tokens(a) == ref and a.stats()["prefix_cache_hits"] > hits  # prefix caching at tp=2: same tokens
    b = Engine(path, tensor_parallel_size=2, **KW)
    assert _tokens(b) == ref and _tokens(a) == ref
    more = [p.pid for p in (*a._tp.procs, *b._tp.procs)]
    del a, b, e
    gc.collect()
    assert _gone(more, within=10.0)

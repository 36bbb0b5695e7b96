"""Heterogeneous-TP KV transfer end to end, in one process: a tp=2 producer (two ranks as threads)
prefills a prompt; its KV heads are mapped into a tp=1 consumer's cache (map_kv_heads +
copy_head_slices, the p2p connector's rule); the consumer decodes from that KV the tp=1 tokens."""

from __future__ import annotations

import pytest
import torch

from hwkv.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from hwkv.engine import Engine
from hwkv.engine.model_runner import ModelRunner
from hwkv.model import load_model
from hwkv.model.tiny import write_tiny_model
from hwkv.parallel.kv_mapping import copy_head_slices, map_kv_heads
from hwkv.parallel.sharding import TPShard
from hwkv.plugins import get_backend
from hwkv.sampling_params import SamplingParams
from hwkv.testing.thread_group import ThreadGroup

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
BS = 16


def _runner(model, backend):
    cache = backend.device.allocate_kv_cache(model.kv_cache_spec(16, BS), backend.attention.kv_layout)
    return ModelRunner(model, backend, cache, BS, 4, 128)


def _new(prompt, out, blocks, computed, scheduled):
    return SchedulerOutput([NewRequestData("r", prompt, out, blocks, computed, GREEDY)], CachedRequestData(),
                           {"r": scheduled}, scheduled, set(), set())


@pytest.mark.parametrize("kv,p_tp,d_tp", [(2, 2, 1), (1, 2, 1), (2, 1, 2), (2, 4, 2), (2, 4, 4)])
def test_transferred_kv_decodes_the_same_tokens(tmp_path, kv, p_tp, d_tp):
    torch.set_num_threads(1)
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=kv, tokenizer=False))
    prompt = list(range(10, 45))  # 35 tokens: 3 blocks
    ref = Engine(path, block_size=BS, num_kv_blocks=16, max_model_len=128).generate([prompt], GREEDY,
                                                                                   use_tqdm=False)[0].token_ids
    backend = get_backend("cpu")

    def ranks(tp):
        group = ThreadGroup(tp)
        models = [load_model(path, backend, load_tokenizer=False,
                             tp=TPShard(r, tp, group.comm(r)) if tp > 1 else None)[0] for r in range(tp)]
        return group, [_runner(m, backend) for m in models]

    # producer: prefill into blocks 3, 7, 9 on every rank
    pg, prod = ranks(p_tp)
    src_blocks, dst_blocks = [3, 7, 9], [1, 2, 5]
    outs = pg.run(lambda r: prod[r].execute(_new(prompt, [], src_blocks, 0, len(prompt))))
    t0 = outs[0].sampled_token_ids["r"][0]
    assert all(o.sampled_token_ids["r"] == [t0] for o in outs) and t0 == ref[0]

    # consumer: the mapped heads into blocks 1, 2, 5, then decode from them (no prefill)
    cg, cons = ranks(d_tp)
    slices = map_kv_heads(kv, p_tp, d_tp)
    copy_head_slices(slices, [p.kv_cache for p in prod], [c.kv_cache for c in cons], list(zip(src_blocks, dst_blocks)))
    toks = [t0]
    so = _new(prompt, [t0], dst_blocks, len(prompt), 1)
    while len(toks) < GREEDY.max_tokens:
        outs = cg.run(lambda r, so=so: cons[r].execute(so))
        toks.append(outs[0].sampled_token_ids["r"][0])
        so = SchedulerOutput([], CachedRequestData(["r"], [None], [len(prompt) + len(toks) - 1]), {"r": 1}, 1,
                             set(), set())
    assert toks == ref


def test_copy_head_slices_moves_exactly_the_mapped_heads():
    from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind

    for layout in KVLayoutKind:
        full = KVCache.allocate(KVCacheSpec(2, 4, 2, 4, 3, torch.float32), layout)
        for t in full.tensors:
            t.copy_(torch.randn(t.shape))
        shards = [KVCache.allocate(KVCacheSpec(2, 4, 2, 2, 3, torch.float32), layout) for _ in range(2)]
        copy_head_slices(map_kv_heads(4, 1, 2), [full], shards, [(1, 2), (3, 0)])
        for r, sh in enumerate(shards):
            for tf, ts in zip(full.tensors, sh.tensors):
                assert torch.equal(ts[[2, 0]], tf[[1, 3]][..., 2 * r:2 * r + 2, :])
                assert not ts[[1, 3]].any()  # untouched blocks
        back = KVCache.allocate(full.spec, layout)
        copy_head_slices(map_kv_heads(4, 2, 1), shards, [back], [(2, 1), (0, 3)])
        for tf, tb in zip(full.tensors, back.tensors):
            assert torch.equal(tb[[1, 3]], tf[[1, 3]])

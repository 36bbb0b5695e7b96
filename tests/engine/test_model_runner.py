"""ModelRunner input building (no model): the step batch and its metadata equal AttentionMetadata.build."""

from __future__ import annotations

import random

import torch

from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.request import Request
from hwkv.core.sched_output import ModelRunnerOutput
from hwkv.core.scheduler import Scheduler, SchedulerConfig
from hwkv.engine.model_runner import ModelRunner
from hwkv.interfaces.attention import AttentionMetadata
from hwkv.plugins import get_backend
from hwkv.sampling_params import SamplingParams

BS = 4


def test_prepare_inputs_matches_reference_build():
    rng = random.Random(0)
    kv = KVCacheManager(256, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=128,
                                      long_prefill_token_threshold=16, max_num_partial_prefills=2), kv)
    runner = ModelRunner(None, get_backend("cpu"), None, BS, 8, 128)
    hasher = make_block_hasher(BS)
    reqs = {}
    for i in range(10):
        prompt = [rng.randrange(10, 500) for _ in range(rng.randint(1, 45))]
        r = Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 12)),
                    block_hasher=hasher, max_tokens=0)
        r.max_tokens = r.sampling_params.max_tokens
        reqs[r.request_id] = r
        sched.add_request(r)
    steps = kinds = 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        states = runner.update_states(so)
        rids = list(so.num_scheduled_tokens)
        before = {rid: reqs[rid].num_computed_tokens - n for rid, n in so.num_scheduled_tokens.items()}
        batch = runner.build_inputs(so, states)
        input_ids, positions, meta, logits_idx, slot_mapping = runner.device_inputs(batch)
        sample_idx = batch.sample_idx.tolist()
        assert slot_mapping is meta.slot_mapping and batch.pure_decode == (meta.num_prefills == 0 == len(
            [r for r in rids if reqs[r].num_computed_tokens < reqs[r].num_tokens]))
        ql = [so.num_scheduled_tokens[r] for r in rids]
        seq = [before[r] + so.num_scheduled_tokens[r] for r in rids]
        ref = AttentionMetadata.build(ql, seq, [kv.get_block_ids(r) for r in rids], BS)
        for f in ("query_start_loc", "seq_lens", "slot_mapping"):
            assert torch.equal(getattr(meta, f), getattr(ref, f)), f
        w = ref.block_tables.shape[1]
        assert torch.equal(meta.block_tables[:, :w], ref.block_tables)
        for f in ("num_prefills", "num_decodes", "num_prefill_tokens", "num_decode_tokens", "max_query_len",
                  "max_seq_len"):
            assert getattr(meta, f) == getattr(ref, f), f
        exp_ids = [t for r in rids for t in reqs[r].all_token_ids[before[r] : before[r] + so.num_scheduled_tokens[r]]]
        exp_pos = [p for r in rids for p in range(before[r], before[r] + so.num_scheduled_tokens[r])]
        assert input_ids.tolist() == exp_ids and positions.tolist() == exp_pos
        done = [i for i, r in enumerate(rids) if reqs[r].num_computed_tokens == reqs[r].num_tokens]
        assert sample_idx == done
        assert logits_idx.tolist() == [int(ref.query_start_loc[i + 1]) - 1 for i in done]
        kinds |= (1 if meta.num_decodes else 0) | (2 if meta.num_prefills and meta.num_decodes else 0)
        toks = [rng.randrange(10, 500) for _ in done]
        runner.record_sampled([states[i] for i in done], toks)
        sched.update_from_output(so, ModelRunnerOutput({rids[i]: [t] for i, t in zip(done, toks)}))
        for rid in so.finished_req_ids:
            assert rid not in runner.reqs
        steps += 1
    assert kinds == 3 and steps > 5  # decode-only and mixed steps both happened
    assert kv.num_free_blocks == 256

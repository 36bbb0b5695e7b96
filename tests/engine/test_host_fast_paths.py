"""The host loop's fast paths give what the general paths give: the plain-greedy argmax (no per-row
sampling parameters gathered) only while every request held is plain, and its bookkeeping survives
finishes, aborts and preemptions."""

from __future__ import annotations

import pytest
import torch

import hwkv
from hwkv.model.sampler import SamplingBatch, sample_tokens
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams

PLAIN = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SPECIAL = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=3),
           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=5)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("fp") / "llama", arch="llama", max_position_embeddings=256))


def test_plain_batch_is_the_argmax_of_the_general_sampler():
    logits = torch.randn(6, 50)
    params = [PLAIN] * 6
    outs = [[1, 2]] * 6
    fast, lp = sample_tokens(logits, SamplingBatch(params, outs, plain=True))
    slow, _ = sample_tokens(logits, SamplingBatch(params, outs))
    assert lp is None and fast.tolist() == slow.tolist()


@pytest.mark.parametrize("special", range(len(SPECIAL)))
def test_a_special_request_turns_the_fast_path_off_and_back_on(model_dir, special):
    prompts = [[7, 8, 9, 10, 7, 8], [11, 12, 13], [20, 21, 22, 23, 24]]
    alone = {}
    for i, p in enumerate(prompts):
        params = SPECIAL[special] if i == 1 else PLAIN
        e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=128)
        alone[i] = e.generate([p], params, use_tqdm=False)[0].token_ids
    e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=128)
    r = e.runner
    e.add_request("a", prompts[0], PLAIN)
    e.step()
    assert r._num_special == 0
    e.add_request("b", prompts[1], SPECIAL[special])
    e.add_request("c", prompts[2], PLAIN)
    e.step()
    assert r._num_special == 1  # b is held: the general sampler serves every row
    done = {}
    while e.has_unfinished():
        done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    assert r._num_special == 0 and not r.reqs
    # the request with sampling features sampled as alone, the plain ones too
    if SPECIAL[special].greedy:
        assert done["b"] == alone[1]
    assert done["a"] == alone[0] and done["c"] == alone[2]


def test_special_count_survives_abort_and_preemption(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=6, block_size=16, max_model_len=96, max_num_batched_tokens=64)
    r = e.runner
    for i in range(4):
        e.add_request(f"s{i}", list(range(10 + i, 40 + i)), SPECIAL[0] if i % 2 else PLAIN)
    aborted = False
    while e.has_unfinished():
        e.step()
        assert r._num_special == sum(not st.plain for st in r.reqs.values())
        if e.scheduler.num_preemptions and not aborted:
            e.abort(["s1", "s3"])
            aborted = True
    assert aborted
    assert r._num_special == 0 and not r.reqs
    assert e.kv_cache_manager.num_free_blocks == 6 and e.scheduler.num_preemptions >= 1

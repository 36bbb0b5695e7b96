"""Engine-level scheduling behaviour: admission limits, policies, priorities (tiny CPU model)."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", max_position_embeddings=256))


def greedy(n: int, **kw) -> hwkv.SamplingParams:
    return hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _no_leak(e: hwkv.Engine) -> None:
    assert not e.has_unfinished() and not e.scheduler.requests
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks


def test_request_larger_than_the_pool_is_refused_at_add_request(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=4, block_size=8)  # 32 tokens; max_model_len capped to 32
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_tokens \(20\) = 40 exceeds the whole KV "
                                         r"cache pool of 4 blocks x 8 tokens = 32 tokens"):
        e.add_request("big", list(range(3, 23)), greedy(20))
    with pytest.raises(ValueError, match="32 tokens"):
        e.generate([list(range(3, 10)), list(range(3, 40))], greedy(4), use_tqdm=False)
    assert not e.scheduler.requests and not e.has_unfinished()  # nothing registered
    (out,) = e.generate([list(range(3, 23))], greedy(12), use_tqdm=False)  # 32 tokens fit exactly
    assert len(out.token_ids) == 12
    _no_leak(e)


def test_priority_scheduling_through_the_engine(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=16, block_size=8, max_num_seqs=1, scheduling_policy="priority")
    ref = hwkv.Engine(model_dir, num_kv_blocks=16, block_size=8).generate(
        [list(range(3, 12)), list(range(20, 29))], greedy(6), use_tqdm=False)
    e.add_request("low", list(range(3, 12)), greedy(6), priority=5)
    e.step()
    e.add_request("high", list(range(20, 29)), greedy(6), priority=-1)
    finished = []
    while e.has_unfinished():
        finished += [o.request_id for o in e.step() if o.finished]
    assert finished == ["high", "low"]  # high displaced low from the only seat
    assert e.stats()["num_preemptions"] == 1
    outs = e.generate([list(range(3, 12)), list(range(20, 29))], greedy(6), use_tqdm=False, priority=[3, 1])
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]  # preemption never changes tokens
    _no_leak(e)


def test_priority_and_policy_validation(model_dir):
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        hwkv.Engine(model_dir, num_kv_blocks=8, block_size=8, scheduling_policy="sjf")
    fcfs = hwkv.Engine(model_dir, num_kv_blocks=8, block_size=8)
    with pytest.raises(ValueError, match=r"priority=2 needs Engine\(scheduling_policy='priority'\)"):
        fcfs.add_request("a", [3, 4], greedy(2), priority=2)
    prio = hwkv.Engine(model_dir, num_kv_blocks=8, block_size=8, scheduling_policy="priority")
    with pytest.raises(ValueError, match="priority must be an int, got True"):
        prio.add_request("a", [3, 4], greedy(2), priority=True)
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        prio.generate([[3, 4], [5, 6]], greedy(2), use_tqdm=False, priority=[1])
    assert not fcfs.scheduler.requests and not prio.scheduler.requests and not prio._tracked


def test_reserve_full_prompt_through_the_engine(model_dir):
    prompts = [list(range(3, 35)), list(range(40, 72))]  # 32 + 8 tokens: 5 blocks each, 8 in the pool
    outs, preempt = {}, {}
    for reserve in (False, True):
        e = hwkv.Engine(model_dir, num_kv_blocks=8, block_size=8, max_num_batched_tokens=16,
                        max_num_partial_prefills=3, reserve_full_prompt=reserve)
        outs[reserve] = [o.token_ids for o in e.generate(prompts, greedy(8), use_tqdm=False)]
        preempt[reserve] = e.stats()["num_preemptions"]
        _no_leak(e)
    assert outs[True] == outs[False]
    assert preempt == {False: 2, True: 0}

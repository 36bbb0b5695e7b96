"""Scheduling policies (FCFS, priority), the waiting-queue abstraction and whole-prompt admission."""

from __future__ import annotations

import pytest

from hwkv.core.request import Request
from hwkv.core.request_queue import FCFSQueue, PriorityQueue
from hwkv.interfaces.connector import KVConnectorBase
from tests.engine.test_scheduler import add, make, req, step


def prio(rid: str, n: int, p: int, max_tokens: int = 8, t: float | None = None) -> Request:
    r = req(rid, n, max_tokens=max_tokens, ignore_eos=True)
    r.priority = p
    if t is not None:
        r.arrival_time = t
    return r


def run_to_end(s, limit: int = 300) -> int:
    steps = 0
    while s.has_unfinished_requests():
        step(s)
        steps += 1
        assert steps < limit, "did not finish"
    assert s.kv.num_free_blocks == s.kv.block_pool.num_blocks and not s.requests
    return steps


def test_priority_queue_order_ties_by_arrival_and_requeue_keeps_place():
    q = PriorityQueue()
    a, b, c, d = prio("a", 1, 5, t=1.0), prio("b", 1, 0, t=3.0), prio("c", 1, 5, t=0.5), prio("d", 1, 0, t=3.0)
    for r in (a, b, c, d):
        q.add_request(r)
    assert [r.request_id for r in q] == ["b", "d", "c", "a"]  # equal (priority, arrival): by request id
    assert q.pop_request() is b and q.peek_request() is d and len(q) == 3
    q.prepend_request(b)  # a preempted request goes back by its key, not to the front
    assert [r.request_id for r in q] == ["b", "d", "c", "a"]
    q.remove_requests([d, c])
    assert [r.request_id for r in q] == ["b", "a"] and bool(q)
    with pytest.raises(IndexError):
        PriorityQueue().peek_request()


def test_fcfs_queue_prepend_keeps_order():
    q = FCFSQueue()
    a, b, c = prio("a", 1, 0), prio("b", 1, 0), prio("c", 1, 0)
    q.add_request(c)
    q.prepend_requests([a, b])
    assert [r.request_id for r in q] == ["a", "b", "c"] and q.peek_request() is a and q[0] is a
    q.remove_requests([b])
    assert [r.pop_request().request_id for r in (q, q)] == ["a", "c"]


def test_priority_admits_lower_value_first():
    s = make(scheduling_policy="priority", max_num_seqs=2)
    add(s, prio("low", 4, 9), prio("mid", 4, 5), prio("high", 4, 1))
    so, _ = step(s)
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high", "mid"]
    run_to_end(s)


def test_fcfs_ignores_priority_and_never_displaces():
    s = make(max_num_seqs=1)
    add(s, prio("low", 4, 9, max_tokens=3))
    step(s)
    add(s, prio("high", 4, 0))
    so, _ = step(s)
    assert not so.preempted_req_ids and list(so.num_scheduled_tokens) == ["low"]
    run_to_end(s)


def test_priority_waiting_request_takes_a_seat_from_a_lower_priority_one():
    s = make(scheduling_policy="priority", max_num_seqs=1)
    add(s, prio("low", 4, 5, max_tokens=20))
    step(s)
    add(s, prio("same", 4, 5))  # equal priority: no displacement (no ping-pong)
    so, _ = step(s)
    assert not so.preempted_req_ids and list(so.num_scheduled_tokens) == ["low"]
    add(s, prio("high", 4, 1, max_tokens=2))
    so, _ = step(s)
    # low was scheduled in phase 1 of this step, then displaced: its tokens are taken back
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 4}
    assert so.total_num_scheduled_tokens == 4 and not so.scheduled_cached_reqs.req_ids
    assert s.requests["low"].num_computed_tokens == 0 and [r.request_id for r in s.running] == ["high"]
    assert [r.request_id for r in s.waiting] == ["low", "same"]  # equal priority: earlier arrival first
    run_to_end(s)
    assert s.num_preemptions == 1


def test_priority_waiting_request_preempts_for_kv_blocks_only_when_it_helps():
    s = make(num_blocks=6, scheduling_policy="priority", max_model_len=24)  # 24 token slots
    add(s, prio("a", 8, 5, max_tokens=4), prio("b", 8, 3, max_tokens=4))  # 2 + 2 blocks (+1 each to decode)
    step(s)
    add(s, prio("huge", 20, 0, max_tokens=2))  # needs 5 blocks: more than a and b can free while b is ...
    add(s, prio("mid", 6, 4, max_tokens=2))
    so, _ = step(s)
    # huge (p0) needs 5 blocks; 2 free + a's 2 + b's 2 = 6 >= 5: both lower-priority requests are displaced
    assert so.preempted_req_ids == {"a", "b"} and [n.req_id for n in so.scheduled_new_reqs] == ["huge"]
    run_to_end(s)


def test_priority_no_pointless_preemption_when_victims_cannot_free_enough():
    s = make(num_blocks=6, scheduling_policy="priority", max_model_len=24)
    add(s, prio("keep", 8, 1, max_tokens=4), prio("low", 4, 9, max_tokens=4))  # 2 + 1 blocks now, 3 + 2 at most
    step(s)
    add(s, prio("big", 20, 5, max_tokens=2))  # 5 blocks; free 3 + low's 1 = 4: preempting low is useless
    so, _ = step(s)
    assert not so.preempted_req_ids and not so.scheduled_new_reqs
    run_to_end(s)
    assert s.num_preemptions == 0


def test_priority_running_phase_preempts_the_lowest_priority_and_unschedules_it():
    s = make(num_blocks=4, scheduling_policy="priority", max_model_len=16, max_num_batched_tokens=64)
    add(s, prio("low", 4, 9, max_tokens=8))
    step(s)
    add(s, prio("high", 4, 0, max_tokens=8))  # running order: low, then high
    while not (so := step(s)[0]).preempted_req_ids:
        assert len(so.num_scheduled_tokens) == 2
    # high needed a 3rd block: the victim is low (lowest priority), not the newest (high), and low's
    # tokens already scheduled earlier in this step are taken back
    assert so.preempted_req_ids == {"low"} and list(so.num_scheduled_tokens) == ["high"]
    assert so.scheduled_cached_reqs.req_ids == ["high"] and so.total_num_scheduled_tokens == 1
    assert s.requests["low"].num_computed_tokens == 0 and [r.request_id for r in s.running] == ["high"]
    run_to_end(s)


def test_priority_request_preempting_itself_does_not_stall_the_others():
    s = make(num_blocks=3, scheduling_policy="priority", max_model_len=12)
    add(s, prio("low", 7, 9, max_tokens=4))
    step(s)
    add(s, prio("high", 3, 0, max_tokens=4))
    so, _ = step(s)
    assert s.kv.num_free_blocks == 0 and set(so.num_scheduled_tokens) == {"low", "high"}
    so, _ = step(s)  # low needs a 3rd block and is itself the victim; high still runs in this step
    assert so.preempted_req_ids == {"low"} and so.num_scheduled_tokens == {"high": 1}
    run_to_end(s)


@pytest.mark.parametrize("reserve", [False, True])
def test_reserve_full_prompt_avoids_admit_then_preempt(reserve):
    """Pool of 8 blocks of 4, budget 8, two 16-token prompts with 4 outputs (5 blocks each, 10 > 8).
    Admitting r1 on its first chunk lets it take blocks r0 needs to decode: r1 is preempted once. With
    reserve_full_prompt r1 waits until its whole prompt fits, and nobody is preempted."""
    s = make(num_blocks=8, max_model_len=64, max_num_batched_tokens=8, max_num_partial_prefills=2,
             reserve_full_prompt=reserve)
    add(s, req("r0", 16, max_tokens=4, ignore_eos=True), req("r1", 16, max_tokens=4, ignore_eos=True))
    outs = {}
    while s.has_unfinished_requests():
        so, sampled = step(s)
        for rid in sampled:
            outs.setdefault(rid, 0)
            outs[rid] += 1
    assert s.num_preemptions == (0 if reserve else 1)
    assert outs == {"r0": 4, "r1": 4} and s.kv.num_free_blocks == 8


def test_reserve_full_prompt_counts_prefix_hits():
    s = make(num_blocks=6, max_model_len=24, max_num_batched_tokens=64, reserve_full_prompt=True)
    add(s, req("a", 16, max_tokens=1, start=0))
    step(s)  # a finishes; its 4 full blocks stay cached
    add(s, req("hold", 4, max_tokens=8), req("b", 20, max_tokens=1, start=0))
    so, _ = step(s)
    # b needs 5 blocks for its prompt, 4 of them are cached hits: 1 new block fits beside hold's
    assert [n.req_id for n in so.scheduled_new_reqs] == ["hold", "b"] and so.num_scheduled_tokens["b"] == 4
    run_to_end(s)


def test_bad_policy_reserve_and_priority():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', 'priority'\], got 'lifo'"):
        make(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="reserve_full_prompt must be a bool"):
        make(reserve_full_prompt=1)
    s = make()
    bad = req("x", 3)
    bad.priority = 1.5
    with pytest.raises(ValueError, match="priority must be an int, got 1.5"):
        s.add_request(bad)
    assert not s.requests



def test_unscheduled_victim_keeps_no_block_registered_for_its_taken_back_chunk():
    """Regression: a victim already scheduled in the step had its chunk's newly full block
    registered in the prefix cache; taking the chunk back must unregister it (its KV is never
    written), and a connector sees only the tokens earlier steps computed when it is preempted."""
    seen = []

    class Spy(KVConnectorBase):
        def request_preempted(self, request):
            seen.append((request.request_id, request.num_computed_tokens, len(s.kv.get_blocks("low"))))

    s = make(num_blocks=6, connector=Spy(), scheduling_policy="priority", long_prefill_token_threshold=6,
             reserve_full_prompt=False)
    low = prio("low", 20, 9, max_tokens=4)
    add(s, low)
    step(s)  # low: prompt tokens 0-6 (2 blocks)
    add(s, prio("high", 4, 0, max_tokens=8))
    step(s)  # low: 6-12 (3 blocks); high: its whole prompt (1 block, 4 slots), samples
    so, _ = step(s)  # low: 12-18 takes the last 2 blocks (block 3 now full); high needs a 2nd: low goes
    assert so.preempted_req_ids == {"low"} and list(so.num_scheduled_tokens) == ["high"]
    assert seen == [("low", 12, 5)]  # before its blocks were freed, counting only what was computed
    assert low.block_hashes[3] not in s.kv.block_pool.cached_block_hash_to_block  # never written
    assert all(h in s.kv.block_pool.cached_block_hash_to_block for h in low.block_hashes[:3])
    run_to_end(s)

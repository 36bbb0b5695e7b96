"""Randomized scheduler workloads: per-step invariants and end-state accounting (hypothesis), under
both scheduling policies (FCFS, priority) and both admission rules (first chunk / whole prompt)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.request import Request, RequestStatus
from hwkv.core.sched_output import ModelRunnerOutput
from hwkv.core.scheduler import Scheduler, SchedulerConfig

BS = 4
MAX_LEN = 48


@st.composite
def workloads(draw):
    chunked = draw(st.booleans())
    budget = draw(st.integers(MAX_LEN if not chunked else 4, 96))
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=budget, max_model_len=MAX_LEN,
        enable_chunked_prefill=chunked, long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5, 16])),
        max_num_partial_prefills=draw(st.integers(1, 3)), scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        reserve_full_prompt=draw(st.booleans()),
    )
    num_blocks = draw(st.integers(MAX_LEN // BS, 40))
    shared = draw(st.lists(st.integers(0, 50), min_size=0, max_size=12))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        n = draw(st.integers(1, 30))
        prefix = shared[:n] if draw(st.booleans()) else []
        prompt = prefix + [1000 * (i + 1) + j for j in range(n - len(prefix))]
        # max_tokens, arrival step, priority
        reqs.append((prompt, draw(st.integers(1, MAX_LEN - n)), draw(st.integers(0, 6)), draw(st.integers(0, 3))))
    abort_at = draw(st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(1, 12))))
    return cfg, num_blocks, reqs, abort_at


STOP = 99  # the token a request emits at its chosen stop index (a stop token)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_scheduler_invariants(async_, work, data):
    """Sync: every step's tokens are applied before the next is planned. Async: step N's tokens are
    applied after step N+1 is planned (placeholders stand in for them), as the engine does."""
    cfg, num_blocks, specs, abort_at = work
    cfg.async_scheduling = async_
    kv = KVCacheManager(num_blocks, BS)
    s = Scheduler(cfg, kv)
    hasher = make_block_hasher(BS)
    reqs = [Request(f"r{i}", p, SimpleNamespace(stop_token_ids=[STOP], ignore_eos=True), block_hasher=hasher,
                    max_tokens=m, priority=prio if cfg.scheduling_policy == "priority" else 0)
            for i, (p, m, _, prio) in enumerate(specs)]
    stop_at = [data.draw(st.one_of(st.none(), st.integers(0, m - 1))) for _, m, _, _ in specs]
    arrivals = {i: a for i, (_, _, a, _) in enumerate(specs)}
    by_id = {r.request_id: r for r in reqs}
    index = {r.request_id: i for i, r in enumerate(reqs)}
    pending = None
    step = 0
    while step < 400:
        for i, a in arrivals.items():
            if a == step:
                s.add_request(reqs[i])
        if abort_at is not None and step == abort_at[1] and abort_at[0] < len(reqs):
            s.finish_requests(reqs[abort_at[0]].request_id, RequestStatus.FINISHED_ABORTED)
        waiting_before = [r.request_id for r in s.waiting]
        ph_before = {r.request_id: r.num_output_placeholders for r in reqs}
        assert all(0 <= ph <= (1 if async_ else 0) for ph in ph_before.values())
        so = s.schedule()
        sched = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(sched.values()) <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert all(n >= 1 for n in sched.values())
        assert not any(r.is_finished for r in (*s.running, *s.waiting))
        # Newly admitted requests are a prefix of the waiting queue in its order (no overtaking).
        new_ids = [n.req_id for n in so.scheduled_new_reqs]
        assert new_ids == waiting_before[: len(new_ids)]
        gone = [by_id[rid] for rid in so.preempted_req_ids]
        if cfg.scheduling_policy == "fcfs":
            assert not (gone and new_ids)  # a step that preempts admits nobody
        else:  # whoever still runs outranks everyone preempted in this step
            rank = lambda r: (r.priority, r.arrival_time)  # noqa: E731
            assert all(rank(r) <= rank(v) for r in s.running for v in gone)
            assert all(v.priority > min(by_id[i].priority for i in new_ids) for v in gone) if new_ids else True
        assert all(r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in gone)
        assert not {r.request_id for r in s.running} & so.preempted_req_ids
        mid = [r for r in s.running if r.num_computed_tokens < r.num_tokens]
        assert len(mid) <= cfg.max_num_partial_prefills
        for rid, n in sched.items():
            r = by_id[rid]
            assert r.num_computed_tokens <= r.num_tokens + ph_before[rid]
            assert r.num_computed_tokens <= MAX_LEN  # never planned past max_model_len
            assert r.num_output_tokens + ph_before[rid] < r.max_tokens  # nor past max_tokens
            if cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
                assert n <= cfg.long_prefill_token_threshold
            if not cfg.enable_chunked_prefill:
                assert r.num_computed_tokens == r.num_tokens + ph_before[rid]  # whole prompts only
        held = {b for r in reqs for b in kv.get_block_ids(r.request_id)}  # prefix-shared blocks once
        assert len(held) + kv.num_free_blocks == num_blocks  # no block lost or double counted
        # the token each sampling request draws: STOP at its stop index, else 7
        sampled = {}
        for rid in sched:
            r = by_id[rid]
            if (r.num_output_placeholders > ph_before[rid]) if async_ else r.num_computed_tokens == r.num_tokens:
                out_idx = r.num_computed_tokens - r.num_prompt_tokens
                sampled[rid] = [STOP if out_idx == stop_at[index[rid]] else 7]
        if async_:
            if pending is not None:
                s.update_from_output(*pending)
            pending = (so, ModelRunnerOutput(sampled))
        else:
            s.update_from_output(so, ModelRunnerOutput(sampled))
        step += 1
        if step > max(arrivals.values()) and not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests(), "workload did not finish"
    assert kv.num_free_blocks == num_blocks and not s.requests
    for i, r in enumerate(reqs):
        if r.status is RequestStatus.FINISHED_ABORTED:
            continue
        m, k = specs[i][1], stop_at[i]
        if k is None:
            assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.output_token_ids == [7] * m
        else:
            assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [7] * k + [STOP]


def test_priority_victim_passed_over_in_this_step():
    """Async, priority: the victim of an allocation is a running request phase 1 passed over in this
    step (its pending token ends it by length), so it holds no tokens of the step to give back (found
    by hypothesis: KeyError in _unschedule)."""
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=48, max_model_len=48, enable_chunked_prefill=False,
                          scheduling_policy="priority", reserve_full_prompt=False)
    specs = [([1000, 1001, 1002], 7, 0, 0), (list(range(2000, 2027)), 3, 4, 0), ([3000], 1, 0, 0), ([4000], 5, 1, 0)]
    test_scheduler_invariants.hypothesis.inner_test(True, (cfg, 12, specs, None), SimpleNamespace(draw=lambda s: None))

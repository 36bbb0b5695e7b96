"""Randomized scheduler workloads: per-step invariants and end-state accounting (hypothesis)."""

from __future__ import annotations

from types import SimpleNamespace

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
        max_num_partial_prefills=draw(st.integers(1, 3)),
    )
    num_blocks = draw(st.integers(MAX_LEN // BS, 40))
    shared = draw(st.lists(st.integers(0, 50), min_size=0, max_size=12))
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        n = draw(st.integers(1, 30))
        prefix = shared[:n] if draw(st.booleans()) else []
        prompt = prefix + [1000 * (i + 1) + j for j in range(n - len(prefix))]
        reqs.append((prompt, draw(st.integers(1, MAX_LEN - n)), draw(st.integers(0, 6))))  # + arrival step
    abort_at = draw(st.one_of(st.none(), st.tuples(st.integers(0, 9), st.integers(1, 12))))
    return cfg, num_blocks, reqs, abort_at


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_invariants(work):
    cfg, num_blocks, specs, abort_at = work
    kv = KVCacheManager(num_blocks, BS)
    s = Scheduler(cfg, kv)
    hasher = make_block_hasher(BS)
    reqs = [Request(f"r{i}", p, SimpleNamespace(stop_token_ids=None, ignore_eos=True), block_hasher=hasher,
                    max_tokens=m) for i, (p, m, _) in enumerate(specs)]
    arrivals = {i: a for i, (_, _, a) in enumerate(specs)}
    step = 0
    while step < 400:
        for i, a in arrivals.items():
            if a == step:
                s.add_request(reqs[i])
        if abort_at is not None and step == abort_at[1] and abort_at[0] < len(reqs):
            s.finish_requests(reqs[abort_at[0]].request_id, RequestStatus.FINISHED_ABORTED)
        waiting_before = [r.request_id for r in s.waiting]
        so = s.schedule()
        sched = so.num_scheduled_tokens
        assert so.total_num_scheduled_tokens == sum(sched.values()) <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        assert all(n >= 1 for n in sched.values())
        # FCFS: the newly admitted requests are a prefix of the waiting queue.
        new_ids = [n.req_id for n in so.scheduled_new_reqs]
        assert new_ids == waiting_before[: len(new_ids)]
        if so.preempted_req_ids:
            assert not new_ids
        by_id = {r.request_id: r for r in reqs}
        mid = [r for r in s.running if r.num_computed_tokens < r.num_tokens]
        assert len(mid) <= cfg.max_num_partial_prefills
        for rid, n in sched.items():
            r = by_id[rid]
            assert r.num_computed_tokens <= r.num_tokens
            if cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
                assert n <= cfg.long_prefill_token_threshold
            if not cfg.enable_chunked_prefill:
                assert r.num_computed_tokens == r.num_tokens  # whole prompts only
        held = {b for r in reqs for b in kv.get_block_ids(r.request_id)}  # prefix-shared blocks once
        assert len(held) + kv.num_free_blocks == num_blocks  # no block lost or double counted
        sampled = {rid: [7] for rid in sched if by_id[rid].num_computed_tokens == by_id[rid].num_tokens}
        s.update_from_output(so, ModelRunnerOutput(sampled))
        step += 1
        if step > max(arrivals.values()) and not s.has_unfinished_requests():
            break
    assert not s.has_unfinished_requests(), "workload did not finish"
    assert kv.num_free_blocks == num_blocks and not s.requests
    for i, r in enumerate(reqs):
        if r.status is RequestStatus.FINISHED_ABORTED:
            continue
        assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED and r.num_output_tokens == specs[i][1]

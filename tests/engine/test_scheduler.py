"""Scheduler unit tests against the real KVCacheManager (no model)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from hwkv.connectors.base import KVConnectorBase
from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.request import Request, RequestStatus
from hwkv.core.sched_output import KVConnectorOutput, ModelRunnerOutput
from hwkv.core.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(num_blocks: int = 64, connector=None, caching: bool = True, **kw) -> Scheduler:
    kw.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(**kw), KVCacheManager(num_blocks, BS, caching), connector)


_starts = itertools.count(1)


def req(rid: str, n: int, max_tokens: int = 8, start: int | None = None, stop_ids=None, ignore_eos=False,
        eos=()) -> Request:
    """Distinct token ids per request unless ``start`` is given (no accidental prefix-cache hits)."""
    start = 1000 * next(_starts) if start is None else start
    sp = SimpleNamespace(stop_token_ids=stop_ids, ignore_eos=ignore_eos)
    return Request(rid, list(range(start, start + n)), sp, block_hasher=make_block_hasher(BS),
                   max_tokens=max_tokens, eos_token_ids=frozenset(eos))


def step(s: Scheduler, tok: int = 7, finished_recving=(), finished_sending=()):
    so = s.schedule()
    sampled = {rid: [tok] for rid in so.num_scheduled_tokens
               if (r := s.requests[rid]).num_computed_tokens == r.num_tokens}
    kco = None
    if finished_recving or finished_sending:
        kco = KVConnectorOutput(set(finished_sending), set(finished_recving))
    s.update_from_output(so, ModelRunnerOutput(sampled, kv_connector_output=kco))
    return so, sampled


def add(s: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        s.add_request(r)


def test_token_budget_and_fcfs_chunking():
    s = make(max_num_batched_tokens=25)
    add(s, req("a", 10), req("b", 10), req("c", 10), req("d", 10))
    so, sampled = step(s)
    # a, b whole; c chunked to the remaining 5 (the one partial prefill allowed); d waits.
    assert so.num_scheduled_tokens == {"a": 10, "b": 10, "c": 5}
    assert so.total_num_scheduled_tokens == 25
    assert set(sampled) == {"a", "b"}  # a partial chunk samples nothing
    assert [r.request_id for r in s.waiting] == ["d"]
    so, sampled = step(s)
    # running first in order (decodes a, b; c's remaining chunk), then d with what is left.
    assert list(so.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 5), ("d", 10)]
    assert [n.req_id for n in so.scheduled_new_reqs] == ["d"]
    assert so.scheduled_cached_reqs.req_ids == ["a", "b", "c"]
    assert set(sampled) == {"a", "b", "c", "d"}


def test_no_chunking_waits_and_never_overtakes():
    s = make(max_num_batched_tokens=25, enable_chunked_prefill=False, max_model_len=25)
    add(s, req("a", 10, max_tokens=2), req("b", 20, max_tokens=2), req("c", 3, max_tokens=2))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 10}  # b does not fit; c must not jump ahead of it
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 20, "c": 3}


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    add(s, req("a", 4), req("b", 4), req("c", 4))
    so, _ = step(s)
    assert set(so.num_scheduled_tokens) == {"a", "b"} and s.num_waiting == 1


def test_long_prefill_threshold_caps_chunks():
    s = make(long_prefill_token_threshold=8)
    add(s, req("a", 20))
    chunks = [step(s)[0].num_scheduled_tokens["a"] for _ in range(4)]
    assert chunks == [8, 8, 4, 1]


@pytest.mark.parametrize("limit", [1, 2])
def test_max_num_partial_prefills(limit):
    s = make(long_prefill_token_threshold=6, max_num_partial_prefills=limit)
    add(s, req("a", 20), req("b", 20), req("c", 3))
    so, _ = step(s)
    if limit == 1:  # c (a whole prompt) would fit but may not overtake b, blocked by the limit
        assert so.num_scheduled_tokens == {"a": 6}
    else:
        assert so.num_scheduled_tokens == {"a": 6, "b": 6, "c": 3}


def test_short_prefills_first_lets_a_whole_prompt_pass_a_waiting_partial():
    """``short_prefills_first``: c (whole in this step) starts while b waits for the one partial-prefill
    slot; b keeps its place at the front and takes the slot as soon as a's prefill ends."""
    s = make(long_prefill_token_threshold=6, max_num_partial_prefills=1, short_prefills_first=True)
    add(s, req("a", 20), req("b", 20), req("c", 3), req("d", 20))
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"a": 6, "c": 3}
    assert [r.request_id for r in s.waiting] == ["b", "d"]
    plan = []
    while s.requests["b"].status is not RequestStatus.RUNNING:
        plan.append(step(s)[0].num_scheduled_tokens)
    assert plan[-1].get("b") == 6 and "d" not in plan[-1]  # a finished its prompt; b before d


def test_preemption_newest_first_requeued_at_front():
    s = make(num_blocks=6)  # 24 slots
    add(s, req("a", 7, max_tokens=20), req("b", 7, max_tokens=20), req("c", 7, max_tokens=20))
    step(s)  # 3 x 2 blocks: pool full
    assert s.kv.num_free_blocks == 0
    s.add_request(req("d", 3))
    so, _ = step(s)  # token 8 of each still fits in 2 blocks; d cannot get a block and waits
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 1}
    so, _ = step(s)  # a needs a 3rd block: c (newest) is preempted, which also makes room for b
    assert so.preempted_req_ids == {"c"} and s.num_preemptions == 1
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c", "d"]  # at the front, ahead of d
    c = s.waiting[0]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert s.kv.get_block_ids("c") == []
    assert so.scheduled_new_reqs == []  # no waiting request is admitted in a step that preempted
    assert so.num_scheduled_tokens == {"a": 1, "b": 1}


def test_preempting_itself_when_newest():
    s = make(num_blocks=5)
    add(s, req("a", 8), req("b", 8))
    step(s)
    so, _ = step(s)  # a takes the last free block; b cannot grow and is itself the newest
    assert so.preempted_req_ids == {"b"} and so.num_scheduled_tokens == {"a": 1}
    assert [r.request_id for r in s.waiting] == ["b"]


def test_preempted_request_resumes_with_its_outputs():
    s = make(num_blocks=5)
    add(s, req("a", 8, max_tokens=8), req("b", 8, max_tokens=8))
    step(s)
    step(s)  # b preempted after its first token
    resumed = []
    while s.has_unfinished_requests():
        so, _ = step(s)
        resumed += [n for n in so.scheduled_new_reqs if n.req_id == "b"]
    (new,) = resumed
    assert new.output_token_ids == [7]  # recompute covers prompt + the token sampled before
    assert s.kv.num_free_blocks == 5 and s.num_preemptions == 1


def test_stop_statuses():
    s = make(max_model_len=12)
    rs = [req("eos", 4, eos=[7]), req("ign", 4, eos=[7], ignore_eos=True, max_tokens=3),
          req("stop", 4, stop_ids=[7]), req("len", 4, max_tokens=2), req("mml", 8, max_tokens=100)]
    add(s, *rs)
    for _ in range(5):
        step(s)
    got = {r.request_id: (r.status, r.num_output_tokens, r.stop_reason) for r in rs}
    assert got == {
        "eos": (RequestStatus.FINISHED_STOPPED, 1, None),
        "ign": (RequestStatus.FINISHED_LENGTH_CAPPED, 3, None),
        "stop": (RequestStatus.FINISHED_STOPPED, 1, 7),
        "len": (RequestStatus.FINISHED_LENGTH_CAPPED, 2, None),
        "mml": (RequestStatus.FINISHED_LENGTH_CAPPED, 4, None),  # 8 + 4 = max_model_len
    }
    assert all(r.finish_time is not None for r in rs)
    assert not s.requests and s.kv.num_free_blocks == 64


def test_abort_frees_blocks_everywhere():
    s = make(num_blocks=16, max_num_batched_tokens=12)
    add(s, req("a", 10), req("b", 10), req("c", 10))
    step(s)  # a whole, b partial, c waiting
    assert s.kv.num_free_blocks < 16
    done = s.finish_requests(["a", "b", "c", "zzz"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"a", "b", "c"}
    assert all(r.status is RequestStatus.FINISHED_ABORTED for r in done)
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests() and not s.requests
    so = s.schedule()
    assert so.finished_req_ids == {"a", "b", "c"} and so.is_empty  # told to the runner once
    assert s.schedule().finished_req_ids == set()


def test_finish_requests_keeps_the_given_order():
    """Finished in the caller's order (duplicates once), not a set's: freeing order (hence block
    reuse) and the engine's abort outputs must not depend on the process's string hash seed."""
    s = make(num_blocks=64)
    ids = [f"r{i}" for i in range(10)]
    add(s, *(req(i, 5) for i in ids))
    order = ids[::-1][:5] + ids[:5]
    done = s.finish_requests([*order, order[0], "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in done] == order


def test_prefix_cache_hit_applied_before_allocation():
    s = make()
    add(s, req("a", 10, max_tokens=1, start=0))
    step(s)  # a finishes after one token; its two full blocks stay cached
    add(s, req("b", 10, max_tokens=1, start=0))
    so, _ = step(s)
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 2}
    assert s.kv.stats.hits == 8


def test_unservable_request_errors_instead_of_looping():
    s = make(num_blocks=4, max_model_len=64)
    add(s, req("huge", 30))
    with pytest.raises(RuntimeError, match="'huge' cannot be scheduled even alone"):
        s.schedule()


def test_duplicate_and_bad_config():
    s = make()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="request_id 'a'"):
        s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


class AsyncLoadConnector(KVConnectorBase):
    """Offers 4 external tokens, loaded asynchronously; keeps finished blocks until 'sent'."""

    def __init__(self):
        self.calls = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.request_id, num_computed_tokens))
        return (4, True) if request.request_id == "remote" else (0, False)

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self.calls.append(("alloc", request.request_id, len(block_ids), num_external_tokens))

    def build_connector_meta(self, so):
        return {"step": len(self.calls)}

    def request_finished(self, request, block_ids):
        return request.request_id == "remote", {"blocks": block_ids}


def test_connector_async_load_and_delay_free():
    conn = AsyncLoadConnector()
    s = make(num_blocks=16, connector=conn)
    add(s, req("remote", 10, max_tokens=2), req("local", 5, max_tokens=1))
    so, _ = step(s)
    r = s.requests["remote"]
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and "remote" not in so.num_scheduled_tokens
    assert so.num_scheduled_tokens == {"local": 5} and so.kv_connector_metadata is not None
    assert ("alloc", "remote", 1, 4) in conn.calls
    so, _ = step(s)  # not loaded yet: still waiting, others are not blocked
    assert "remote" not in so.num_scheduled_tokens and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, finished_recving={"remote"})
    so, _ = step(s)  # load done: compute the remaining 6 tokens on top of the 4 loaded
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 4 and so.num_scheduled_tokens == {"remote": 6}
    step(s)
    assert r.is_finished and s.kv.get_block_ids("remote")  # delay_free: blocks still held
    step(s, finished_sending={"remote"})
    assert s.kv.num_free_blocks == 16


class _Reversed(set):
    """A set iterating in descending order (as a set may, under another string hash seed)."""

    def __iter__(self):
        return iter(sorted(set.__iter__(self), reverse=True))


class DelayAllConnector(KVConnectorBase):
    def request_finished(self, request, block_ids):
        return True, None


def test_connector_finished_sending_frees_in_id_order():
    """Delayed-free blocks go back to the pool in request-id order whatever the set's iteration
    order: the free queue (which blocks are reused next) is the same in every process."""
    ids = [f"r{i}" for i in range(6)]

    def free_queue(finished: set) -> list[int]:
        s = make(num_blocks=32, connector=DelayAllConnector())
        reqs = [req(i, 5, max_tokens=1, start=100 * n) for n, i in enumerate(ids)]
        add(s, *reqs)
        step(s)
        assert all(r.is_finished for r in reqs) and set(s.delayed_free) == set(ids)
        step(s, finished_sending=finished)
        assert not s.delayed_free
        return [b.block_id for b in s.kv.block_pool.free_block_queue]

    assert free_queue(_Reversed(ids)) == free_queue(set(ids)) == free_queue(dict.fromkeys(sorted(ids)).keys())


class SyncLoadConnector(KVConnectorBase):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (8, False) if request.request_id == "ext" else (0, False)


def test_connector_sync_external_hit():
    s = make(num_blocks=16, connector=SyncLoadConnector())
    add(s, req("ext", 10, max_tokens=1))
    so, sampled = step(s)
    (new,) = so.scheduled_new_reqs
    # 8 tokens' KV come from the connector this step; the model computes the last 2 and samples.
    assert new.num_computed_tokens == 8 and so.num_scheduled_tokens == {"ext": 2} and sampled == {"ext": [7]}
    assert len(new.block_ids) == 3
    assert s.kv.num_free_blocks == 16


def test_connector_failed_load_falls_back_to_recompute():
    conn = AsyncLoadConnector()
    s = make(num_blocks=16, connector=conn)
    add(s, req("remote", 10, max_tokens=1))
    step(s)
    r = s.requests["remote"]
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    so = s.schedule()
    conn.get_num_new_matched_tokens = lambda request, n: (0, False)  # the connector no longer offers it
    conn.request_finished = lambda request, block_ids: (False, None)
    failed = KVConnectorOutput(failed_recving={"remote"})
    s.update_from_output(so, ModelRunnerOutput({}, kv_connector_output=failed))
    assert r.status is RequestStatus.WAITING and r.num_computed_tokens == 0 and not s.kv.get_block_ids("remote")
    so, sampled = step(s)
    assert so.num_scheduled_tokens == {"remote": 10} and sampled == {"remote": [7]}
    assert s.kv.num_free_blocks == 16 and not s.has_unfinished_requests()


def test_a_request_held_back_for_steps_counts_one_prefix_query():
    """The head of the waiting queue is looked up every step it waits; the hit rate counts it once."""
    # a takes 4 of the 8-token budget per step; b fits the rest only as a second partial prefill
    s = make(max_num_batched_tokens=8, long_prefill_token_threshold=4, max_num_partial_prefills=1)
    add(s, req("a", 30), req("b", 30))
    steps = 0
    while s.requests["b"].status is not RequestStatus.RUNNING:
        step(s)
        steps += 1
    assert steps > 2  # b waited behind a's partial prefill
    assert s.kv.stats.requests == 2 and s.kv.stats.queries == 60


def test_a_request_whose_kv_arrived_goes_before_one_waiting_for_its_blocks():
    """A request preempted to the front of the queue needs blocks that a request behind it holds
    (its remote KV arrived into them): the loaded one runs first and frees them, instead of the
    queue holding with nothing running (which failed as 'cannot be scheduled even alone')."""
    class InFlight(AsyncLoadConnector):
        loading = True  # as p2p's: transfers pending until the load settled

        def has_pending_transfers(self):
            return self.loading

    conn = InFlight()
    s = make(num_blocks=8, connector=conn)
    add(s, req("remote", 16, max_tokens=2))
    step(s)
    remote = s.requests["remote"]
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KVS and s.kv.num_free_blocks == 7
    big = req("big", 29, max_tokens=2)  # 8 blocks: more than the 7 free
    add(s, big)
    s.waiting.remove_requests([big])
    s.waiting.prepend_request(big)  # where a preempted request goes
    step(s, finished_recving={"remote"})
    conn.loading = False  # settled with its arrival: nothing in flight any more
    so, _ = step(s)
    assert list(so.num_scheduled_tokens) == ["remote"]
    for _ in range(10):
        if big.is_finished:
            break
        step(s, finished_sending={"remote"} if remote.is_finished else ())
    assert remote.is_finished and big.is_finished

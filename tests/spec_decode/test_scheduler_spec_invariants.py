"""Randomized speculative workloads through the scheduler and KV cache manager (hypothesis).

A fake runner verifies each request's scheduled drafts against the request's true token stream
(draft j is right with a drawn probability) and emits the accepted drafts plus the true next token,
as the rejection sampler does for greedy requests. Per step: the budget counts drafts, drafts are
scheduled only after the last known token, every request holds slots for its computed tokens plus
the lookahead, no block is cached beyond verified tokens, rejected drafts are rolled back; at the
end every request's output is its true stream (stop token / max_tokens honoured mid-draft) and
every block is free.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.request import Request, RequestStatus
from hwkv.core.sched_output import ModelRunnerOutput
from hwkv.core.scheduler import Scheduler, SchedulerConfig

BS, MAX_LEN, STOP = 4, 48, 99


def _true(i: int, j: int, stop_at: int | None) -> int:
    return STOP if j == stop_at else 7 + (i * 3 + j) % 5


@st.composite
def workloads(draw):
    chunked = draw(st.booleans())
    cfg = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(MAX_LEN if not chunked else 3, 64)),
        max_model_len=MAX_LEN, enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 5])), max_num_partial_prefills=draw(st.integers(1, 2)),
        reserve_full_prompt=draw(st.booleans()),
    )
    k = draw(st.integers(1, 5))
    la = draw(st.sampled_from([0, k]))
    shared = draw(st.lists(st.integers(0, 50), max_size=10))
    reqs = []
    for i in range(draw(st.integers(1, 7))):
        n = draw(st.integers(1, 24))
        prefix = shared[:n] if draw(st.booleans()) else []
        m = draw(st.integers(1, MAX_LEN - n))
        stop_at = draw(st.one_of(st.none(), st.integers(0, m - 1)))
        reqs.append((prefix + [1000 * (i + 1) + j for j in range(n - len(prefix))], m, stop_at))
    return cfg, draw(st.integers(MAX_LEN // BS + 2, 40)), k, la, reqs


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.data())
def test_speculative_scheduling_invariants(work, data):
    cfg, num_blocks, k, la, specs = work
    kv = KVCacheManager(num_blocks, BS)
    s = Scheduler(cfg, kv, num_lookahead_tokens=la)
    hasher = make_block_hasher(BS)
    reqs = [Request(f"r{i}", p, SimpleNamespace(stop_token_ids=[STOP], ignore_eos=True), block_hasher=hasher,
                    max_tokens=m) for i, (p, m, _) in enumerate(specs)]
    for r in reqs:
        s.add_request(r)
    by_id = {r.request_id: (i, r) for i, r in enumerate(reqs)}
    p_right = data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    for _ in range(600):
        if not s.has_unfinished_requests():
            break
        known = {r.request_id: r.num_tokens for r in reqs}
        so = s.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= cfg.max_num_batched_tokens
        out = ModelRunnerOutput(sampled_token_ids={}, spec_token_ids={})
        for rid, n in so.num_scheduled_tokens.items():
            i, r = by_id[rid]
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            c = r.num_computed_tokens - n
            assert len(drafts) == max(0, c + n - known[rid])  # drafts only after the last known token
            assert len(drafts) <= k
            assert len(kv.get_block_ids(rid)) * BS >= r.num_computed_tokens + la  # slots incl. lookahead
            assert kv.num_cached_block.get(rid, 0) * BS <= known[rid]  # nothing cached past verified tokens
            if c + n < known[rid]:
                continue  # a prefill chunk: nothing sampled
            j0 = r.num_output_tokens
            emitted = []
            for d in drafts:
                truth = _true(i, j0 + len(emitted), specs[i][2])
                if d != truth:
                    break
                emitted.append(d)
            emitted.append(_true(i, j0 + len(emitted), specs[i][2]))
            out.sampled_token_ids[rid] = emitted
            nxt_out = j0 + len(emitted)
            cap = max(0, min(k, r.max_tokens - nxt_out, MAX_LEN - (r.num_tokens + len(emitted))) - 1)
            out.spec_token_ids[rid] = [
                _true(i, nxt_out + j, specs[i][2]) if data.draw(st.floats(0, 1)) < p_right else 3
                for j in range(cap)]
        s.update_from_output(so, out)
        for rid in out.sampled_token_ids:
            _, r = by_id[rid]
            if not r.is_finished:
                assert r.num_computed_tokens == r.num_tokens - 1  # rejected drafts rolled back
                assert r.num_tokens + len(r.spec_token_ids) <= MAX_LEN
                # several tokens appended at once hash every block they fill, as one at a time would
                assert r.block_hashes == Request("x", r.all_token_ids, block_hasher=hasher).block_hashes
        held = {b for r in reqs for b in kv.get_block_ids(r.request_id)}
        assert len(held) + kv.num_free_blocks == num_blocks
    assert not s.has_unfinished_requests(), "workload did not finish"
    assert kv.num_free_blocks == num_blocks and not s.requests
    for i, r in enumerate(reqs):
        m, stop_at = specs[i][1], specs[i][2]
        n = m if stop_at is None else stop_at + 1
        assert r.output_token_ids == [_true(i, j, stop_at) for j in range(n)]
        assert r.status is (RequestStatus.FINISHED_LENGTH_CAPPED if stop_at is None else RequestStatus.FINISHED_STOPPED)
    st_ = s.spec_stats
    assert st_.accepted_tokens <= st_.draft_tokens

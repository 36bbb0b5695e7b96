"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute.

One step (vLLM v1 order) has two phases:

1. ``_schedule_running``: RUNNING requests in order (decodes and continuing prefill chunks alike). A
   request that cannot get blocks preempts the policy's victim (FCFS: the newest running request;
   priority: the lowest-priority one) — blocks freed, it restarts from token 0 and goes back to the
   waiting queue (the prefix cache usually rescues its work) — until it fits or is itself the victim.
2. ``_schedule_waiting``, unless a preemption happened in phase 1: waiting requests in the queue's
   order (``hwkv.core.request_queue``): prefix-cache hit and the connector's external hit first, then
   ``allocate_slots``; the first one that does not fit (budget, ``max_num_seqs``, blocks, partial-
   prefill limit, or its whole prompt with ``reserve_full_prompt``) stops the scan — no overtaking —
   unless the policy lets it displace running requests (priority: strictly lower-priority ones).

Failure containment: the requests of a step whose execution failed are requeued as *suspects*
(``suspects``). A suspect is admitted only into an otherwise empty step and, until it samples a
token (then it is cleared), nothing else is admitted: a failure while it runs alone is its own.

A request "is computed" up to ``num_computed_tokens``, which the scheduler advances when it
schedules; a token is sampled only when the scheduled chunk reaches the request's last token.

KV connector loads: a *synchronous* external hit (``load_async=False``) is computed on in the step
that loads it; until that step's output confirms the load (``sched_results``), the request is not
planned again (async scheduling would otherwise build on KV that may turn out wrong). A failed one
loses that step's token and restarts from its local prefix-cache hit by recompute.

Async scheduling (``SchedulerConfig.async_scheduling``): step N+1 is planned while step N runs,
before N's tokens are known. A request that will sample in a step gets a *placeholder*
(``num_output_placeholders``) that counts as a token when N+1 is planned; ``update_from_output``
(``hwkv.core.sched_results``) replaces it with the real token. A request whose pending token will end
it by length is not planned again; one that ends by EOS/stop is planned once more and that token is
dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hwkv.core.request import Request, RequestStatus
from hwkv.core.sched_config import SchedulerConfig
from hwkv.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from hwkv.core.sched_policy import make_policy
from hwkv.core.sched_results import SchedulerResults
from hwkv.core.spec_stats import SpecDecodeStats
from hwkv.interfaces.connector import KVConnectorBase

__all__ = ["Scheduler", "SchedulerConfig"]


@dataclass
class _Step:
    """Working state of one ``schedule()`` call."""

    budget: int
    num_sched: dict[str, int] = field(default_factory=dict)  # batch order: running, then new
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    partial: set[str] = field(default_factory=set)  # mid-prefill after this step
    placeholders: set[str] = field(default_factory=set)  # async: got a placeholder this step
    spec: dict[str, list[int]] = field(default_factory=dict)  # drafts scheduled for verification


class Scheduler(SchedulerResults):
    def __init__(self, config: SchedulerConfig, kv_cache_manager: Any, connector: KVConnectorBase | None = None,
                 num_lookahead_tokens: int = 0):
        self.config = config
        self.kv = kv_cache_manager
        self._grouped = hasattr(kv_cache_manager, "step_block_ids")  # KV-cache groups (hwkv.core.kv_groups)
        self.connector = connector  # None: no connector (hwkv.connectors.make_connector)
        if connector is not None:
            connector.bind_kv_cache_manager(kv_cache_manager)
        self.policy = make_policy(config.scheduling_policy)
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.new_queue()
        self.running: list[Request] = []  # in admission order
        self.finished_req_ids: set[str] = set()  # reported to the runner in the next output
        self.delayed_free: dict[str, Request] = {}  # finished, blocks held by the connector
        self.finished_recving: set[str] = set()
        self.num_preemptions = 0
        self._num_slots: dict[str, int] = {}  # KV slots (blocks x block_size) each request holds
        self.suspects: set[str] = set()  # in a failed step, not yet run alone (module docstring)
        # speculative decoding: KV slots held past each step's tokens for a model proposer's drafts
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodeStats()
        self.loading: dict[str, int] = {}  # synchronous external loads not yet confirmed: rid -> tokens
        self.remote_ext: dict[str, int] = {}  # asynchronous loads in flight: rid -> tokens
        self.num_external_hit_tokens = 0  # prompt tokens whose KV a connector supplied (confirmed)
        self.num_load_failures = 0
        self.num_load_kept_tokens = 0  # tokens a failed load had landed, kept as prefix-cache entries
        self._dropped: set[str] = set()  # rolled back outside schedule(): the runner drops their state

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if not isinstance(request.priority, int) or isinstance(request.priority, bool):
            raise ValueError(f"priority must be an int, got {request.priority!r}")
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop-string) requests wherever they are, in the order given (their blocks
        are freed, and the engine's outputs come, in that order); unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        # not a set: its order follows the per-process string hash seed
        ids = (request_ids,) if isinstance(request_ids, str) else dict.fromkeys(request_ids)
        done = [r for rid in ids if (r := self.requests.get(rid)) is not None and not r.is_finished]
        if not done:
            return []
        gone = {r.request_id for r in done}
        self.running = [r for r in self.running if r.request_id not in gone]
        self.waiting.remove_requests([r for r in done if r.status is not RequestStatus.RUNNING])
        for r in done:
            r.status = status
            self._free(r)
        return done

    def has_unfinished_requests(self) -> bool:
        # blocks a connector holds (delayed free, transfers in flight) are released only by steps
        return bool(self.waiting or self.running or self.delayed_free or self._transfers_pending())

    def _transfers_pending(self) -> bool:
        return self.connector is not None and self.connector.has_pending_transfers()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        st = _Step(cfg.max_num_batched_tokens)
        self._schedule_running(st)
        if not st.preempted:  # short of blocks: admit nobody this step
            self._schedule_waiting(st)
        if not st.num_sched and not self.running and self.waiting and not st.preempted:
            self._check_servable(self.waiting.peek_request())
        out = SchedulerOutput(
            scheduled_new_reqs=st.new_reqs,
            scheduled_cached_reqs=st.cached,
            num_scheduled_tokens=st.num_sched,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - st.budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=st.preempted | self._dropped if self._dropped else st.preempted,
            scheduled_spec_decode_tokens=st.spec,
        )
        self.finished_req_ids, self._dropped = set(), set()
        if self._grouped:
            out.group_block_ids = self.kv.step_block_ids(st.new_reqs, st.cached)
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _schedule_running(self, st: _Step) -> None:
        """Phase 1: every running request, in order, gets its next chunk (or decode token)."""
        cfg, kv, running = self.config, self.kv, self.running
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        bs, slots, max_len, la = kv.block_size, self._num_slots, cfg.max_model_len, self.num_lookahead_tokens
        cached, num_sched = st.cached, st.num_sched
        # hot loop (hundreds of decodes per step): locals, no property calls
        loading, async_sched, partial, placeholders = self.loading, cfg.async_scheduling, st.partial, st.placeholders
        grouped = self._grouped
        add_id, add_blocks, add_computed = cached.req_ids.append, cached.new_block_ids.append, \
            cached.num_computed_tokens.append
        i = 0
        while i < len(running) and st.budget > 0:
            req = running[i]
            rid, c, ph = req.request_id, req.num_computed_tokens, req.num_output_placeholders
            if loading and rid in loading:  # async: its load's step has not reported yet (module docstring)
                i += 1
                continue
            nt = len(req.all_token_ids)
            if ph and (len(req.output_token_ids) + ph >= req.max_tokens or nt + ph >= max_len):
                i += 1  # its pending token ends it by length: nothing more to plan
                continue
            n = nt + ph + len(req.spec_token_ids) - c
            if threshold and n > threshold:
                n = threshold
            if n > st.budget:
                n = st.budget
            if n <= 0:  # nothing left to compute (a failed step was rolled back elsewhere)
                i += 1
                continue
            if c + n + la <= slots[rid] and (c + n) // bs == c // bs and not grouped:
                new_ids = None  # fits the held blocks and fills none: allocate_slots would be a no-op
                # (with KV-cache groups it frees the blocks that left a window: called every step)
            else:
                while (blocks := kv.allocate_slots(req, n, num_lookahead_tokens=la)) is None:
                    v = self.policy.victim(running)
                    victim = running.pop(v)
                    if v < i:  # already passed this step: give back the tokens it got, if any
                        i -= 1
                        if victim.request_id in st.num_sched:
                            self._unschedule(victim, st)
                    self._preempt(victim, st)
                    if victim is req:
                        break
                if blocks is None:
                    continue  # req preempted itself; running[i] is now the next request
                new_ids = None
                if blocks:
                    slots[rid] += len(blocks) * bs
                    new_ids = [b.block_id for b in blocks]
            if c + n < nt + ph:
                partial.add(rid)
            elif async_sched:
                req.num_output_placeholders += 1
                placeholders.add(rid)
            if req.spec_token_ids:  # drafts past the last known token are verified; the rest dropped
                num_spec = c + n - nt - ph
                del req.spec_token_ids[max(num_spec, 0):]
                if num_spec > 0:
                    st.spec[rid] = list(req.spec_token_ids)
            num_sched[rid] = n
            add_id(rid)
            add_blocks(new_ids)
            add_computed(c)
            req.num_computed_tokens = c + n
            st.budget -= n
            i += 1

    def _schedule_waiting(self, st: _Step) -> None:
        """Phase 2: admit waiting requests in queue order until one does not fit."""
        cfg, kv, running, waiting = self.config, self.kv, self.running, self.waiting
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        skipped: list[Request] = []  # waiting for remote KV: back at the front after the scan
        displaced: list[Request] = []  # preempted for an admission: not re-admitted in this step
        if self.finished_recving and waiting.peek_request().request_id not in self.finished_recving:
            # their KV arrived into blocks they hold: they go first, or a request preempted in front
            # of them, waiting for those very blocks, would hold the queue with nothing running
            ready = [r for r in waiting if r.request_id in self.finished_recving]
            waiting.remove_requests(ready)
            waiting.prepend_requests(ready)
        # a running suspect keeps its steps to itself until it samples (module docstring)
        isolated = bool(self.suspects) and any(r.request_id in self.suspects for r in running)
        while waiting and st.budget > 0:
            req = waiting.peek_request()
            suspect = req.request_id in self.suspects
            if st.num_sched and (suspect or isolated):
                break
            if displaced and req.priority >= displaced[-1].priority:
                break  # would run while a request it does not outrank was just displaced
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving:
                    skipped.append(waiting.pop_request())
                    continue
                self.finished_recving.discard(req.request_id)
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                req.status = RequestStatus.WAITING
            seats_full = len(running) >= cfg.max_num_seqs
            if seats_full and not any(self.policy.may_displace(req, r) for r in running):
                break
            new_blocks, num_local, num_ext, load_async = None, 0, 0, False
            # prompt_logprobs need every prompt token computed: no prefix-cache or connector hits (as vLLM)
            if req.num_computed_tokens == 0 and getattr(req.sampling_params, "prompt_logprobs", None) is None:
                new_blocks, num_local = kv.get_computed_blocks(req, record_stats=False)
                if self.connector is not None:
                    num_ext, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                # At least the last token must be computed to produce logits, whatever is offered.
                num_ext = max(0, min(num_ext, req.num_tokens - 1 - num_local))
            num_computed = req.num_computed_tokens or num_local + num_ext
            if load_async:
                n = 0
            else:
                remaining = n = req.num_tokens - num_computed
                if threshold and n > threshold:
                    n = threshold
                if n > st.budget:
                    if not cfg.enable_chunked_prefill:
                        break
                    n = st.budget
                if n < remaining and len(st.partial) >= cfg.max_num_partial_prefills:
                    if not cfg.short_prefills_first:
                        break
                    # it keeps its place at the front; requests behind it whose whole rest fits go now
                    skipped.append(waiting.pop_request())
                    continue
            # blocks to find: this step's tokens, or the whole rest of the prompt with reserve_full_prompt
            want = req.num_tokens - req.num_computed_tokens - num_local if cfg.reserve_full_prompt else n + num_ext
            short = kv.num_blocks_short(req, max(want, n + num_ext), num_local, new_blocks)
            if seats_full or short:
                victims = self._victims_for(req, short, new_blocks or ())
                if victims is None:
                    break
                for victim in victims:
                    running.remove(victim)
                    if victim.request_id in st.num_sched:
                        self._unschedule(victim, st)
                    self._preempt(victim, st, requeue=False)
                    displaced.append(victim)
            blocks = kv.allocate_slots(req, n + num_ext, num_local, new_blocks, self.num_lookahead_tokens,
                                       num_external_tokens=num_ext)
            if blocks is None:
                break
            waiting.pop_request()
            self._admit(req, st, n, num_computed, num_local, num_ext, load_async, new_blocks is not None)
            if load_async:
                skipped.append(req)
            if suspect:
                break
        if skipped:
            waiting.prepend_requests(skipped)
        for victim in displaced:
            waiting.prepend_request(victim)

    def _admit(self, req: Request, st: _Step, n: int, num_computed: int, num_local: int, num_ext: int,
               load_async: bool, looked_up: bool) -> None:
        """Bookkeeping of a waiting request that got its blocks (connector hook, stats, output)."""
        kv, rid = self.kv, req.request_id
        block_ids = kv.get_block_ids(rid)
        self._num_slots[rid] = len(block_ids) * kv.block_size
        if self.connector is not None:
            self.connector.update_state_after_alloc(req, block_ids, num_ext)
        if looked_up and kv.enable_caching:  # count a lookup once, on admission
            kv.record_prefix_query(req, num_local)
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        if num_ext:  # counted as external hits once the load is confirmed
            (self.remote_ext if load_async else self.loading)[rid] = num_ext
        if load_async:
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return
        if num_computed + n < req.num_tokens:
            st.partial.add(rid)
        elif self.config.async_scheduling:
            req.num_output_placeholders += 1
            st.placeholders.add(rid)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        st.num_sched[rid] = n
        st.new_reqs.append(NewRequestData(rid, req.prompt_token_ids, list(req.output_token_ids), block_ids,
                                          num_computed, req.sampling_params))
        req.num_computed_tokens = num_computed + n
        st.budget -= n

    def _victims_for(self, req: Request, short: int, keep: Iterable[Any]) -> list[Request] | None:
        """Running requests the policy lets ``req`` displace, lowest rank first: at least one (which
        frees a seat) and enough to free ``short`` blocks; ``None`` when even all of them would not do."""
        keep = list(keep)
        chosen: list[Request] = []
        for r in self.policy.displace_order(self.running):
            if not self.policy.may_displace(req, r):
                continue
            chosen.append(r)
            if self.kv.num_reclaimable_blocks([v.request_id for v in chosen], keep) >= short:
                return chosen
        return None

    def _unschedule(self, req: Request, st: _Step) -> None:
        """Take back what phase 1 gave ``req`` in this step (it is being preempted)."""
        rid = req.request_id
        st.budget += st.num_sched.pop(rid)
        k = st.cached.req_ids.index(rid)
        req.num_computed_tokens = c = st.cached.num_computed_tokens[k]
        self.kv.uncache_blocks(req, c)  # registered as full by this step's allocation, never written
        del st.cached.req_ids[k], st.cached.new_block_ids[k], st.cached.num_computed_tokens[k]
        st.partial.discard(rid)
        st.spec.pop(rid, None)
        if rid in st.placeholders:
            st.placeholders.discard(rid)
            req.num_output_placeholders -= 1

    def _preempt(self, req: Request, st: _Step | None = None, requeue: bool = True) -> None:
        if self.connector is not None:  # its blocks are still held; num_computed_tokens is exact
            self.connector.request_preempted(req)
        self.kv.free(req)
        self._num_slots.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.spec_token_ids.clear()
        self.num_preemptions += 1
        if st is not None:
            st.preempted.add(req.request_id)
        if requeue:
            self.waiting.prepend_request(req)

    def _check_servable(self, req: Request) -> None:
        """Nothing runs and the head request still cannot start: fail loudly instead of spinning."""
        if self.delayed_free or req.status is RequestStatus.WAITING_FOR_REMOTE_KVS or self._transfers_pending():
            return  # blocks or KV are on their way back
        bs = self.kv.block_size
        need = -(-min(req.num_tokens, self.config.max_model_len) // bs)
        raise RuntimeError(
            f"request {req.request_id!r} cannot be scheduled even alone: it needs {need} KV blocks "
            f"for {req.num_tokens} tokens and only {self.kv.num_free_blocks} are free "
            f"(raise num_kv_blocks / memory_fraction or lower max_model_len)"
        )

"""Continuous-batching scheduler: token budget, chunked prefill, preemption by recompute.

One step (vLLM v1 order):

1. RUNNING requests in order (decodes and continuing prefill chunks alike). A request that
   cannot get blocks preempts the newest running request (its blocks are freed, it restarts from
   token 0 at the FRONT of the waiting queue; the prefix cache usually rescues its work) until
   it fits or is itself the newest.
2. WAITING requests FCFS, unless a preemption happened this step: prefix-cache hit and the
   connector's external hit first, then ``allocate_slots``; the first one that does not fit
   (budget, ``max_num_seqs``, blocks, partial-prefill limit) stops the scan — no overtaking.

Failure containment: the requests of a step whose execution failed are requeued as *suspects*
(``suspects``). A suspect is admitted only into an otherwise empty step and, until it samples a
token (then it is cleared), nothing else is admitted: a failure while it runs alone is its own.

A request "is computed" up to ``num_computed_tokens``, which the scheduler advances when it
schedules; a token is sampled only when the scheduled chunk reaches the request's last token.

Async scheduling (``SchedulerConfig.async_scheduling``): step N+1 is planned while step N runs,
before N's tokens are known. A request that will sample in a step gets a *placeholder*
(``num_output_placeholders``) that counts as a token when N+1 is planned and is replaced by the
real token in ``update_from_output``. A request whose pending token will end it by length is not
planned again; one that ends by EOS/stop is planned once more and that token is dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hwkv.core.request import Request, RequestStatus
from hwkv.core.sched_output import (
    CachedRequestData,
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

_LAST_UNFINISHED = RequestStatus.PREEMPTED


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step
    max_num_partial_prefills: int = 1  # requests allowed to be mid-prefill at once
    async_scheduling: bool = False  # plan step N+1 before step N's tokens arrive (placeholders)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_partial_prefills"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is off, or a long prompt could never run"
            )


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: Any, connector: KVConnectorBase | None = None):
        self.config = config
        self.kv = kv_cache_manager
        self.connector = connector or NoOpConnector()
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # reported to the runner in the next output
        self.delayed_free: dict[str, Request] = {}  # finished, blocks held by the connector
        self.finished_recving: set[str] = set()
        self.num_preemptions = 0
        self._num_slots: dict[str, int] = {}  # KV slots (blocks x block_size) each request holds
        self.suspects: set[str] = set()  # in a failed step, not yet run alone (module docstring)

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (abort, stop-string) requests wherever they are; unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status.name}")
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        done = [r for rid in ids if (r := self.requests.get(rid)) is not None and not r.is_finished]
        if not done:
            return []
        gone = {r.request_id for r in done}
        self.running = [r for r in self.running if r.request_id not in gone]
        if any(r.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.PREEMPTED)
               for r in done):
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
        for r in done:
            r.status = status
            self._free(r)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg, kv = self.config, self.kv
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else 0
        num_sched: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        num_partial = 0

        # 1. running requests, oldest first; preempt from the tail when blocks run out.
        bs, slots, max_len = kv.block_size, self._num_slots, cfg.max_model_len
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            rid, c, ph = req.request_id, req.num_computed_tokens, req.num_output_placeholders
            if ph and (req.num_output_tokens + ph >= req.max_tokens or req.num_tokens + ph >= max_len):
                i += 1  # its pending token ends it by length: nothing more to plan
                continue
            n = len(req.all_token_ids) + ph + len(req.spec_token_ids) - c
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            if n <= 0:  # nothing left to compute (a failed step was rolled back elsewhere)
                i += 1
                continue
            if c + n <= slots[rid] and (c + n) // bs == c // bs:
                blocks = None  # fits the held blocks and fills none: allocate_slots would be a no-op
            else:
                while (blocks := kv.allocate_slots(req, n)) is None:
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted.add(victim.request_id)
                    if victim is req:
                        break
                if req.status is RequestStatus.PREEMPTED:
                    break
                if blocks:
                    slots[rid] += len(blocks) * bs
            if c + n < len(req.all_token_ids) + ph:
                num_partial += 1
            elif cfg.async_scheduling:
                req.num_output_placeholders += 1
            num_sched[rid] = n
            cached.req_ids.append(rid)
            cached.new_block_ids.append([b.block_id for b in blocks] if blocks else None)
            cached.num_computed_tokens.append(c)
            req.num_computed_tokens = c + n
            budget -= n
            i += 1

        # 2. waiting requests, FCFS; none while we are short of blocks.
        # a running suspect keeps its steps to itself until it samples (module docstring)
        isolated = bool(self.suspects) and any(r.request_id in self.suspects for r in self.running)
        if not preempted:
            skipped: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                req = self.waiting[0]
                suspect = req.request_id in self.suspects
                if num_sched and (suspect or isolated):
                    break
                if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if req.request_id not in self.finished_recving:
                        skipped.append(self.waiting.popleft())
                        continue
                    self.finished_recving.discard(req.request_id)
                    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                    req.status = RequestStatus.WAITING
                new_blocks, num_local, num_ext, load_async = None, 0, 0, False
                if req.num_computed_tokens == 0:
                    new_blocks, num_local = kv.get_computed_blocks(req, record_stats=False)
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
                    if n > budget:
                        if not cfg.enable_chunked_prefill:
                            break
                        n = budget
                    if n < remaining and num_partial >= cfg.max_num_partial_prefills:
                        break
                blocks = kv.allocate_slots(
                    req, n + num_ext, num_local, new_blocks, num_external_tokens=num_ext
                )
                if blocks is None:
                    break
                self.waiting.popleft()
                block_ids = kv.get_block_ids(req.request_id)
                self._num_slots[req.request_id] = len(block_ids) * kv.block_size
                self.connector.update_state_after_alloc(req, block_ids, num_ext)
                if new_blocks is not None and kv.enable_caching:  # count a lookup once, on admission
                    kv.record_prefix_query(req, num_local)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_computed
                if load_async:
                    req.num_computed_tokens = num_computed
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    skipped.append(req)
                    continue
                if num_computed + n < req.num_tokens:
                    num_partial += 1
                elif cfg.async_scheduling:
                    req.num_output_placeholders += 1
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                num_sched[req.request_id] = n
                new_reqs.append(
                    NewRequestData(req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                                   block_ids, num_computed, req.sampling_params)
                )
                req.num_computed_tokens = num_computed + n
                budget -= n
                if suspect:
                    break
            if skipped:
                self.waiting.extendleft(reversed(skipped))

        if not num_sched and not self.running and self.waiting and not preempted:
            self._check_servable(self.waiting[0])

        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_sched,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def requeue(self, sched_out: SchedulerOutput) -> list[str]:
        """Undo a step whose execution failed: its requests restart by recompute from the front of
        the waiting queue (FCFS order kept) and finished ids are reported again. Returns their ids."""
        scheduled = sched_out.num_scheduled_tokens
        victims = [r for r in self.running if r.request_id in scheduled]
        self.running = [r for r in self.running if r.request_id not in scheduled]
        for req in reversed(victims):
            self._preempt(req)
            req.num_output_placeholders = 0  # the failed step's tokens never arrive
        self.finished_req_ids |= sched_out.finished_req_ids
        return [r.request_id for r in victims]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self._num_slots.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.spec_token_ids.clear()
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _check_servable(self, req: Request) -> None:
        """Nothing runs and the head request still cannot start: fail loudly instead of spinning."""
        if self.delayed_free or req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            return  # blocks or KV are on their way back
        bs = self.kv.block_size
        need = -(-min(req.num_tokens, self.config.max_model_len) // bs)
        raise RuntimeError(
            f"request {req.request_id!r} cannot be scheduled even alone: it needs {need} KV blocks "
            f"for {req.num_tokens} tokens and only {self.kv.num_free_blocks} are free "
            f"(raise num_kv_blocks / memory_fraction or lower max_model_len)"
        )

    # ---- results ----------------------------------------------------------------------------
    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns the requests that received tokens this step (finished ones included), in batch order.
        """
        max_len, requests = self.config.max_model_len, self.requests
        updated: list[Request] = []
        any_finished = False
        if self.suspects:
            self.suspects.difference_update(runner_out.sampled_token_ids)
        for rid, toks in runner_out.sampled_token_ids.items():  # partial prefill chunks sample nothing
            req = requests.get(rid)
            if req is None or req.status > _LAST_UNFINISHED:
                continue  # aborted while the step ran
            if req.num_output_placeholders:
                req.num_output_placeholders -= len(toks)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            sp = req.sampling_params
            stop_ids = sp.stop_token_ids if sp is not None else None
            check_eos = not (sp is not None and sp.ignore_eos)
            for tok in toks:
                req.append_output_token_ids(tok)
                status = None
                if check_eos and tok in req.eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif stop_ids and tok in stop_ids:
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                elif len(req.output_token_ids) >= req.max_tokens or len(req.all_token_ids) >= max_len:
                    status = RequestStatus.FINISHED_LENGTH_CAPPED
                if status is not None:
                    req.status = status
                    any_finished = True
                    break
            updated.append(req)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            if self.config.async_scheduling:  # preempted while its last token was in flight
                self.waiting = deque(r for r in self.waiting if not r.is_finished)
            for req in updated:
                if req.is_finished:
                    self._free(req)
        if runner_out.kv_connector_output is not None:
            self._update_connector(runner_out.kv_connector_output)
        return updated

    def _free(self, req: Request) -> None:
        if req.finish_time is None:
            req.finish_time = time.monotonic()
        delay, _params = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
        self.finished_req_ids.add(req.request_id)
        self.finished_recving.discard(req.request_id)
        self.suspects.discard(req.request_id)
        self._num_slots.pop(req.request_id, None)
        if delay:
            self.delayed_free[req.request_id] = req
        else:
            self.kv.free(req)
        del self.requests[req.request_id]

    def _update_connector(self, out: KVConnectorOutput) -> None:
        for rid in out.finished_sending:
            if (req := self.delayed_free.pop(rid, None)) is not None:
                self.kv.free(req)
        # Only loads of requests still waiting for them count: an aborted request's id may be reused.
        self.finished_recving |= {
            rid for rid in out.finished_recving
            if (r := self.requests.get(rid)) is not None and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        for rid in out.failed_recving:
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.kv.free(req)  # recompute from scratch; the connector must not offer it again
                self._num_slots.pop(rid, None)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
        self.connector.update_connector_output(out)

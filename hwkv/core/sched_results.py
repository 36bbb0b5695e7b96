"""Applying what comes back from a step: sampled tokens, stop conditions, frees, connector
completions — and rolling back a step whose execution failed. Mixed into ``Scheduler``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hwkv.core.request import Request, RequestStatus
from hwkv.core.sched_output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from hwkv.interfaces.connector import KVConnectorBase

_LAST_UNFINISHED = RequestStatus.PREEMPTED


class SchedulerResults:
    # Scheduler state this part reads and writes (set up by Scheduler.__init__).
    config: Any
    kv: Any
    connector: KVConnectorBase | None
    requests: dict[str, Request]
    waiting: Any
    running: list[Request]
    finished_req_ids: set[str]
    delayed_free: dict[str, Request]
    finished_recving: set[str]
    suspects: set[str]
    loading: dict[str, int]
    remote_ext: dict[str, int]
    num_external_hit_tokens: int
    num_load_failures: int
    num_load_kept_tokens: int
    _dropped: set[str]
    _num_slots: dict[str, int]
    spec_stats: Any
    _preempt: Callable[[Request], None]

    def update_from_output(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns the requests that received tokens this step (finished ones included), in batch order.
        """
        max_len, requests = self.config.max_model_len, self.requests
        updated: list[Request] = []
        any_finished = False
        if self.loading:
            self._settle_loads(sched_out, runner_out)
        if self.suspects:
            self.suspects.difference_update(runner_out.sampled_token_ids)
        spec_sched, spec_next = sched_out.scheduled_spec_decode_tokens, runner_out.spec_token_ids
        record_spec = self.spec_stats.record
        now = time.monotonic()
        # the hot loop of a large batch: plain attribute reads, one token appended without a list
        for rid, toks in runner_out.sampled_token_ids.items():  # partial prefill chunks sample nothing
            req = requests.get(rid)
            if req is None or req.status > _LAST_UNFINISHED:
                continue  # aborted while the step ran
            if req.num_output_placeholders:
                req.num_output_placeholders -= len(toks)
            if spec_sched and toks and (spec := spec_sched.get(rid)):
                # rejected drafts' KV is garbage: recompute from the first of them
                req.num_computed_tokens -= len(spec) + 1 - len(toks)
                record_spec(len(spec), len(toks) - 1)
            if req.first_token_time is None:
                req.first_token_time = now
            sp = req.sampling_params
            stop_ids = sp.stop_token_ids if sp is not None else None
            eos = req.eos_token_ids if not (sp is not None and sp.ignore_eos) else ()
            out_ids = req.output_token_ids
            if (len(toks) > 1 and len(out_ids) + len(toks) < req.max_tokens
                    and len(req.all_token_ids) + len(toks) < max_len and not any(map(eos.__contains__, toks))
                    and not (stop_ids and any(map(stop_ids.__contains__, toks)))):
                # speculative steps' several tokens, none of which stops it: appended at once
                req.append_output_token_ids(toks)
                toks = ()
            for tok in toks:
                req.append_output_token(tok)
                status = None
                if tok in eos:
                    status = RequestStatus.FINISHED_STOPPED
                elif stop_ids and tok in stop_ids:
                    status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tok
                elif len(out_ids) >= req.max_tokens or len(req.all_token_ids) >= max_len:
                    status = RequestStatus.FINISHED_LENGTH_CAPPED
                if status is not None:
                    req.status = status
                    any_finished = True
                    break
            if spec_next is not None and req.status <= _LAST_UNFINISHED:
                req.spec_token_ids = spec_next.get(rid, [])
            updated.append(req)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
            if self.config.async_scheduling:  # preempted while its last token was in flight
                self.waiting.remove_requests([r for r in updated if r.is_finished])
            for req in updated:
                if req.is_finished:
                    self._free(req)
        if runner_out.kv_connector_output is not None:
            self._update_connector(runner_out.kv_connector_output)
        return updated

    def _settle_loads(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> None:
        """Confirm or undo the synchronous connector loads of the step ``sched_out``: a load the
        connector reports failed loses the step's token and restarts by recompute (its local
        prefix-cache hit is kept: those blocks were never the connector's, and so are the blocks the
        load did land, ``valid_tokens``: it recomputes only the rest)."""
        kvo = runner_out.kv_connector_output
        failed = kvo.failed_recving if kvo is not None else ()
        valid = kvo.valid_tokens if kvo is not None else {}
        for new in sched_out.scheduled_new_reqs:
            n_ext = self.loading.pop(new.req_id, None)
            req = self.requests.get(new.req_id)
            if n_ext is None or req is None or req.is_finished:
                continue
            if new.req_id not in failed:
                self.num_external_hit_tokens += n_ext
                if req.status is RequestStatus.RUNNING:  # the loaded blocks are now real prefix-cache entries
                    self.kv.cache_blocks(req, min(req.num_computed_tokens, req.num_tokens))
                continue
            self.num_load_failures += 1
            runner_out.sampled_token_ids.pop(new.req_id, None)  # computed on KV that never arrived
            if runner_out.logprobs:
                runner_out.logprobs.pop(new.req_id, None)
            req.num_output_placeholders = 0
            req.num_cached_tokens = -1  # set again on re-admission
            if req.status is not RequestStatus.RUNNING:  # preempted meanwhile: it recomputes already
                continue
            self.running.remove(req)
            self.kv.uncache_blocks(req, new.num_computed_tokens - n_ext)
            self._keep_landed(req, valid.get(new.req_id, 0), new.num_computed_tokens, n_ext)
            self.kv.free(req)
            self._num_slots.pop(req.request_id, None)
            req.num_computed_tokens = 0
            req.spec_token_ids.clear()
            req.status = RequestStatus.PREEMPTED
            self.waiting.prepend_request(req)
            self._dropped.add(req.request_id)

    def _keep_landed(self, req: Request, valid: int, loaded_to: int, n_ext: int) -> None:
        """Register the blocks a failed load did land (its first ``valid`` tokens, at most the
        ``loaded_to`` the load of ``n_ext`` tokens was to reach) before the request's blocks are freed:
        its re-admission hits them in the prefix cache (every group's rule applies) and recomputes only
        the rest. ``num_load_kept_tokens`` counts the loaded tokens so kept."""
        if valid > 0 and self.kv.enable_caching:
            self.kv.cache_blocks(req, min(valid, loaded_to))
            self.num_load_kept_tokens += max(0, min(valid, loaded_to) - (loaded_to - n_ext))

    def _free(self, req: Request) -> None:
        if req.finish_time is None:
            req.finish_time = time.monotonic()
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
        if params is not None:
            req.kv_transfer_params = params
        self.loading.pop(req.request_id, None)
        self.remote_ext.pop(req.request_id, None)
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
        # Blocks are freed in id order, not the sets' (which follow the process's string hash seed),
        # so which blocks are reused next is the same in every run.
        for rid in sorted(out.finished_sending):
            if (req := self.delayed_free.pop(rid, None)) is not None:
                self.kv.free(req)
        # Only loads of requests still waiting for them count: an aborted request's id may be reused.
        done = {
            rid for rid in out.finished_recving
            if (r := self.requests.get(rid)) is not None and r.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        }
        self.finished_recving |= done
        for rid in done:
            self.num_external_hit_tokens += self.remote_ext.pop(rid, 0)
        for rid in sorted(out.failed_recving):
            req = self.requests.get(rid)
            if req is not None and req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.num_load_failures += 1
                n_ext = self.remote_ext.pop(rid, 0)
                req.num_cached_tokens = -1
                self._keep_landed(req, out.valid_tokens.get(rid, 0), req.num_computed_tokens, n_ext)
                self.kv.free(req)  # recompute (past its hits); the connector must not offer it again
                self._num_slots.pop(rid, None)
                req.num_computed_tokens = 0
                req.status = RequestStatus.WAITING
        if self.connector is not None:
            self.connector.update_connector_output(out)

    def requeue(self, sched_out: SchedulerOutput) -> list[str]:
        """Undo a step whose execution failed: its requests restart by recompute from the front of
        the waiting queue (queue order kept) and finished ids are reported again. Returns their ids."""
        scheduled = sched_out.num_scheduled_tokens
        victims = [r for r in self.running if r.request_id in scheduled]
        self.running = [r for r in self.running if r.request_id not in scheduled]
        cached = sched_out.scheduled_cached_reqs
        before = dict(zip(cached.req_ids, cached.num_computed_tokens))  # computed before the step
        before.update((n.req_id, n.num_computed_tokens) for n in sched_out.scheduled_new_reqs)
        for req in reversed(victims):
            self.loading.pop(req.request_id, None)  # its load's step never reports
            req.num_computed_tokens = before[req.request_id]  # the failed step computed nothing
            self.kv.uncache_blocks(req, req.num_computed_tokens)  # blocks the step was to fill
            self._preempt(req)
            req.num_output_placeholders = 0  # the failed step's tokens never arrive
        self.finished_req_ids |= sched_out.finished_req_ids
        return [r.request_id for r in victims]

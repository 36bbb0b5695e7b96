"""Request tracking: the engine-side state of each request (caller's id, detokenizer, logprobs),
validation into a :class:`~hwkv.core.request.Request`, ids, and building ``RequestOutput`` values.

:class:`RequestTracking` is a base of :class:`~hwkv.engine.engine.Engine`; it reads the parts
``build_parts`` set (``scheduler``, ``runner``, ``tokenizer``, ``kv_cache`` ...) and the id maps
``Engine.__init__`` creates."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from hwkv.core.request import Request, RequestStatus
from hwkv.engine.detokenizer import IncrementalDetokenizer
from hwkv.engine.prompt import Prompt, tokenize_prompt
from hwkv.outputs import CompletionMetrics, RequestOutput
from hwkv.sampling_params import SamplingParams

LAST_UNFINISHED = RequestStatus.PREEMPTED  # statuses above it are finished
_FINISH_REASONS = {s: s.finish_reason for s in RequestStatus}


@dataclass
class Tracked:
    """Engine-side state of one request: the caller's id, prompt text, detokenizer, logprobs,
    emitted count, and why it failed (finish_reason "error")."""

    request_id: str
    prompt: str | None
    detok: IncrementalDetokenizer
    logprobs: list[Any] | None
    num_seen: int = 0
    prompt_logprobs: list[Any] | None = None  # one per prompt token (the first None), filled as computed
    error: str | None = None
    metrics: CompletionMetrics | None = None  # the last output's, shared by later ones while unchanged


class RequestTracking:
    """Validation, id bookkeeping and output building of :class:`~hwkv.engine.engine.Engine`."""

    scheduler: Any
    runner: Any
    tokenizer: Any
    kv_cache: Any
    _tracked: dict[str, Tracked]
    _live: dict[str, str]
    _pending: list[RequestOutput]
    _ids: itertools.count
    _seq: itertools.count

    def _make_request(self, request_id: str, prompt: Prompt, params: Any) -> tuple[Request, Tracked]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if self._in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use (request ids must be unique; "
                             "an id is free again once step() returned its final output)")
        params = self.default_sampling_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        n, m, lim = len(ids), params.max_tokens, self.max_model_len
        nb = self.kv_cache.spec.num_blocks
        if n + m > nb * self.block_size:  # could never run, even alone: refuse now, not at schedule time
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds the whole KV cache pool of "
                f"{nb} blocks x {self.block_size} tokens = {nb * self.block_size} tokens (allowed: prompt length "
                f"+ max_tokens <= {min(lim, nb * self.block_size)}; raise num_kv_blocks / memory_fraction)"
            )
        if n + m > lim:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds max_model_len {lim} "
                f"(allowed: prompt length + max_tokens <= {lim})"
            )
        if params.prompt_logprobs is not None and not self.runner.serves_prompt_logprobs:
            raise ValueError(f"SamplingParams.prompt_logprobs is not supported by {type(self.runner).__name__} "
                             "(speculative decoding, tensor_parallel_size > 1) (allowed: prompt_logprobs=None there)")
        if params.structured_outputs is not None:
            if self.config.speculative is not None:
                raise ValueError("SamplingParams.structured_outputs is not supported with speculative decoding "
                                 "(allowed: structured outputs on an engine without speculative_config)")
            self.runner.structured.compile(params.structured_outputs)  # a bad grammar is refused here, cached
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "SamplingParams.stop needs a tokenizer, and this model directory has no tokenizer.json "
                "(allowed: stop_token_ids)"
            )
        req = Request(f"{request_id}-{next(self._seq)}", ids, params, block_hasher=self._hasher,
                      eos_token_ids=self.eos_token_ids, max_tokens=m, cache_salt=params.cache_salt,
                      kv_transfer_params=params.kv_transfer_params)
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        return req, Tracked(request_id, text, detok, [] if params.logprobs is not None else None,
                            prompt_logprobs=[None] * n if params.prompt_logprobs is not None else None)

    def default_sampling_params(self) -> Any:
        """SamplingParams for requests given none: the checkpoint's generation_config.json values
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens → max_tokens) over
        the SamplingParams defaults; invalid checkpoint values are ignored with a warning."""
        d = dict(getattr(self.generation_config, "defaults", None) or {})
        if "max_new_tokens" in d:
            d["max_tokens"] = d.pop("max_new_tokens")
        try:
            return SamplingParams(**d)
        except (TypeError, ValueError) as e:
            import warnings

            warnings.warn(f"ignoring generation_config.json sampling defaults {d}: {e}", stacklevel=2)
            return SamplingParams()

    def _check_priority(self, priority: Any) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        policy = self.scheduler.config.scheduling_policy
        if priority and policy != "priority":
            raise ValueError(f"priority={priority} needs Engine(scheduling_policy='priority') "
                             f"(this engine schedules {policy!r}; allowed: priority=0)")

    def _track(self, req: Request, tracked: Tracked) -> None:
        self._tracked[req.request_id] = tracked
        self._live[tracked.request_id] = req.request_id

    def _untrack(self, internal_id: str) -> Tracked:
        tr = self._tracked.pop(internal_id)
        del self._live[tr.request_id]
        self.runner.release(internal_id)
        return tr

    def _finish(self, internal_ids: list[str], status: RequestStatus, error: str | None = None) -> None:
        """Finish unfinished requests wherever they are; their final outputs go to the next step()."""
        for req in self.scheduler.finish_requests(internal_ids, status):
            tr = self._untrack(req.request_id)
            tr.error = error
            self._pending.append(self._output(req, tr))

    def _end(self, req: Request, status: RequestStatus) -> None:
        """Finish a request that just got tokens (the scheduler may have finished it already)."""
        if not req.is_finished:
            self.scheduler.finish_requests(req.request_id, status)
        req.status = status

    def _output(self, req: Request, tr: Tracked) -> RequestOutput:
        status = req.status
        finished = status > LAST_UNFINISHED
        detok = tr.detok
        metrics = tr.metrics
        # after the first token only a preemption or the finish changes a request's metrics
        if finished or metrics is None or metrics.first_token_time is None \
                or metrics.num_preemptions != req.num_preemptions:
            metrics = tr.metrics = CompletionMetrics(req.arrival_time, req.first_token_time, req.finish_time,
                                                     max(req.num_cached_tokens, 0), req.num_preemptions)
        return RequestOutput(
            tr.request_id, tr.prompt, req.prompt_token_ids, detok.text if finished else detok.stable_text,
            req.output_token_ids.copy(), finished, _FINISH_REASONS.get(status), metrics, req.stop_reason,
            tr.logprobs.copy() if tr.logprobs is not None else None,
            req.kv_transfer_params if finished else None, tr.error,
            tr.prompt_logprobs if tr.prompt_logprobs is not None and req.output_token_ids else None,
        )

    def _next_id(self) -> str:
        while True:
            rid = str(next(self._ids))
            if not self._in_use(rid):
                return rid

    def _in_use(self, rid: str) -> bool:
        # generate() tells its requests' outputs apart by id: an id whose final output is still
        # pending must not be handed out again
        return rid in self._live or any(o.request_id == rid for o in self._pending)

"""AsyncEngine: the asyncio front end over an engine-core process.

::

    async with AsyncEngine("path/to/hf-dir", backend="cpu") as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
            print(out.text)          # cumulative, like Engine.step() outputs; the last one is final

The front end owns everything textual: it validates and tokenizes prompts, detokenizes the token
ids the core sends each step, matches stop strings (and aborts the request in the core when one
ends it) and builds :class:`hwkv.RequestOutput`. Outputs coalesce: a consumer slower than the
engine sees the newest state, never a backlog. Leaving the ``async for`` early (a client
disconnect cancels it) aborts the request in the core, which frees its blocks. If the core dies,
every pending and later request raises :class:`EngineDeadError` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hwkv.engine.detokenizer import IncrementalDetokenizer
from hwkv.engine.prompt import Prompt, tokenize_prompt
from hwkv.engine.structured import StructuredOutputs
from hwkv.model.tokenizer import Tokenizer, has_tokenizer
from hwkv.outputs import CompletionMetrics, RequestOutput
from hwkv.sampling_params import SamplingParams
from hwkv.serving import messages as m
from hwkv.serving.client import CoreClient, EngineDeadError


@dataclass(eq=False)
class _Req:
    """Front-end state of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    error: Exception | None = None  # raised by the iterator: refused by the core, or the core died
    exec_error: str | None = None  # finish_reason "error": why executing it failed
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's, once finished
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncEngine:
    """``AsyncEngine(model, **engine_kwargs)``: the same keyword arguments as :class:`hwkv.Engine`
    (JSON values: the backend by name), plus ``kv_connector``/``kv_connector_config`` by name.
    ``metrics`` (optional) gets ``on_tokens(req, n, itl)`` for each step's new tokens (``itl``:
    seconds since the previous ones, ``None`` for the first) and ``on_finished(req)``."""

    def __init__(self, model: str | Path, *, kv_connector: str | None = None,
                 kv_connector_config: dict[str, Any] | None = None, metrics: Any = None,
                 startup_timeout: float = 600.0, **engine_kwargs: Any):
        self.model = str(model)
        self.client = CoreClient(self.model, engine_kwargs, kv_connector, kv_connector_config)
        self.metrics = metrics
        self.startup_timeout = startup_timeout
        self.info: m.Ready | None = None
        self.tokenizer: Any = None
        self.core_stats: dict[str, Any] = {}
        self.dead: EngineDeadError | None = None
        self._reqs: dict[str, _Req] = {}  # by core request id
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self.last_heard = time.monotonic()  # the last message from the core (any kind)
        self._structured: Any = None  # grammars compiled to check requests (hwkv.engine.structured)

    # ---- life cycle ---------------------------------------------------------------------------
    async def start(self) -> AsyncEngine:
        """Start the core and wait until its engine is built (``EngineDeadError`` says why not; an
        unreadable tokenizer.json raises ``ModelLoadError``). On any failure nothing is left behind:
        no core process, socket or socket directory."""
        try:
            if has_tokenizer(self.model):
                self.tokenizer = Tokenizer.from_dir(self.model)
            self.info = await self.client.start(self.startup_timeout, self._core_died)
        except BaseException:  # the client bound its sockets at construction
            await asyncio.shield(self.client.close())
            raise
        self.last_heard = time.monotonic()
        self._reader = asyncio.create_task(self._read_outputs(), name="hwkv-core-outputs")
        return self

    def check_structured(self, spec: dict[str, Any]) -> None:
        """``ValueError`` if ``spec`` (``SamplingParams.structured_outputs``) is not a valid grammar:
        checked here so the caller can name its field; compiled grammars are cached."""
        if self._structured is None:
            info = self.info
            assert info is not None, "start() the engine first"
            self._structured = StructuredOutputs(self.tokenizer, info.vocab_size, tuple(info.eos_token_ids))
        self._structured.compile(spec)

    def core_silent_s(self) -> float:
        """Seconds since the core last sent anything (it sends at least every second while it loops)."""
        return time.monotonic() - self.last_heard

    def fail_requests(self, why: str) -> None:
        """End every pending request with ``EngineDeadError(why)`` (each is aborted in the core), the
        engine staying up: a server that stops cuts its streams with an error event this way."""
        self._fail_all(EngineDeadError(why))

    async def shutdown(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.client.close()
        self.dead = self.dead or EngineDeadError("the engine was shut down")
        self._fail_all(self.dead)

    async def __aenter__(self) -> AsyncEngine:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        return self.info is not None and self.dead is None

    @property
    def num_unfinished(self) -> int:
        return len(self._reqs)

    # ---- requests -----------------------------------------------------------------------------
    def make_params(self, **overrides: Any) -> SamplingParams:
        """The checkpoint's default SamplingParams (generation_config.json) with ``overrides``;
        ``ValueError`` names an invalid field."""
        assert self.info is not None, "start() the engine first"
        return replace(self.info.default_params, **overrides)

    def _make(self, prompt: Prompt, params: SamplingParams | None, request_id: str) -> _Req:
        if self.dead is not None:
            raise self.dead
        info = self.info
        assert info is not None, "start() the engine first"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        params = info.default_params if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.validate(info.vocab_size)
        text, ids = tokenize_prompt(prompt, self.tokenizer, info.vocab_size)
        n, k, lim = len(ids), params.max_tokens, info.max_model_len
        if n + k > lim:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({k}) = {n + k} exceeds max_model_len {lim} "
                             f"(allowed: prompt length + max_tokens <= {lim})")
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer, and this model directory has no "
                             "tokenizer.json (allowed: stop_token_ids)")
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                       params.include_stop_str_in_output)
        return _Req(request_id, text, ids, params, detok, logprobs=[] if params.logprobs is not None else None)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]:
        """An iterator of cumulative outputs until the request finishes (the last has ``finished=True``;
        ``finish_reason "error"`` with ``error`` set if executing it failed).

        Validates now (``ValueError`` naming what is wrong; ``EngineDeadError`` if the core is
        gone); the request is sent to the core when iteration starts. Closing or cancelling the
        iterator early aborts the request in the core. ``priority`` (lower runs first) needs a
        core with ``scheduling_policy="priority"``."""
        request_id = request_id or f"req-{next(self._ids)}"
        req = self._make(prompt, params, request_id)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if priority and self.info.scheduling_policy != "priority":  # type: ignore[union-attr]
            raise ValueError(f"priority={priority} needs the engine's scheduling_policy 'priority' "
                             f"(this one runs {self.info.scheduling_policy!r}; allowed: priority 0)")  # type: ignore[union-attr]
        return self._stream(req, priority)

    async def _stream(self, req: _Req, priority: int = 0) -> AsyncIterator[RequestOutput]:
        core_id = f"{req.request_id}#{next(self._ids)}"  # unique even if the caller reuses ids
        if self.dead is not None:
            raise self.dead
        self._reqs[core_id] = req
        try:
            core_params = replace(req.params, stop=None) if req.params.stop else req.params
            await self.client.send(m.AddRequest(core_id, req.prompt_token_ids, core_params, priority))
            while True:
                await req.changed.wait()
                req.changed.clear()
                if req.error is not None:
                    raise req.error
                out = self._output(req)
                yield out
                if out.finished:
                    return
        finally:  # left early (closed, cancelled, an error): abort in the core
            if self._reqs.pop(core_id, None) is not None and req.finish_reason is None and self.dead is None:
                self._finish(req, "abort")
                await self._abort_core([core_id])

    async def abort(self, request_id: str) -> None:
        """Abort a request by the id given to ``generate``; its iterator ends with finish_reason "abort"."""
        ids = [cid for cid, r in self._reqs.items() if r.request_id == request_id and r.finish_reason is None]
        for cid in ids:
            self._finish(self._reqs[cid], "abort")
        if ids:
            await self._abort_core(ids)

    async def _abort_core(self, core_ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # a closed socket during shutdown: nothing left to abort
            await asyncio.shield(self.client.send(m.Abort(core_ids)))

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The core's engine stats now (``hwkv.Engine.stats()`` keys)."""
        if self.dead is not None:
            raise self.dead
        self.core_stats = await self.client.utility("stats", timeout)
        return self.core_stats

    # ---- outputs ------------------------------------------------------------------------------
    def _output(self, req: _Req) -> RequestOutput:
        done = req.finish_reason is not None
        metrics = CompletionMetrics(req.arrival, req.first_token_time, req.finish_time, req.num_cached_tokens,
                                    req.num_preemptions)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            text=req.detok.text if done else req.detok.stable_text, token_ids=list(req.token_ids),
            finished=done, finish_reason=req.finish_reason, metrics=metrics, stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.logprobs is not None else None, error=req.exec_error,
            kv_transfer_params=req.kv_transfer_params if done else None, prompt_logprobs=req.prompt_logprobs,
        )

    async def _read_outputs(self) -> None:
        try:
            while True:
                msg = await self.client.recv()
                self.last_heard = time.monotonic()
                if isinstance(msg, m.StepOutputs):
                    if msg.stats is not None:
                        self.core_stats = msg.stats
                    stopped = [cid for o in msg.outputs if self._apply(o, cid := o.request_id)]
                    if stopped:
                        await self._abort_core(stopped)
                elif isinstance(msg, m.UtilityResult):
                    self.client.resolve(msg)
                elif isinstance(msg, m.Dead):
                    self._core_died(f"engine core failed: {msg.error}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an undecodable message: the two sides disagree; nothing can proceed
            self._core_died(f"engine core output could not be read: {type(e).__name__}: {e}")

    def _apply(self, o: m.CoreOutput, core_id: str) -> bool:
        """Apply one request's step output; True when a stop string ended it (the core must abort)."""
        req = self._reqs.get(core_id)
        if req is None or req.finish_reason is not None:  # aborted/stopped here already
            return False
        if o.finish_reason == "rejected":
            req.finish_reason = "rejected"
            req.error = ValueError(o.error or "the engine core refused the request")
            req.changed.set()
            return False
        if o.finish_reason == "error":
            req.exec_error = o.error or "executing the request failed"
        now = time.monotonic()
        req.num_cached_tokens, req.num_preemptions = o.num_cached_tokens, o.num_preemptions
        if o.kv_transfer_params is not None:
            req.kv_transfer_params = o.kv_transfer_params
        if o.new_token_ids:
            itl = None if req.last_token_time is None else now - req.last_token_time
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            if self.metrics is not None:
                self.metrics.on_tokens(req, len(o.new_token_ids), itl)
            req.token_ids.extend(o.new_token_ids)
            if req.logprobs is not None and o.logprobs:
                req.logprobs.extend(o.logprobs)
            if o.prompt_logprobs is not None:
                req.prompt_logprobs = o.prompt_logprobs
        stop = req.detok.add_tokens(o.new_token_ids, len(req.token_ids) >= req.params.min_tokens)
        if stop is not None:
            self._finish(req, "stop", stop)
            return o.finish_reason is None
        if o.finish_reason is not None:
            self._finish(req, o.finish_reason, o.stop_reason)
        req.changed.set()
        return False

    def _finish(self, req: _Req, reason: str, stop_reason: int | str | None = None) -> None:
        req.finish_reason, req.stop_reason = reason, stop_reason
        req.finish_time = time.monotonic()
        if self.metrics is not None:
            self.metrics.on_finished(req)
        req.changed.set()

    def _core_died(self, why: str) -> None:
        if self.dead is None and not self.client.closing:
            self.dead = EngineDeadError(why)
            self.client.fail_calls(self.dead)
            self._fail_all(self.dead)

    def _fail_all(self, error: Exception) -> None:
        for req in self._reqs.values():
            if req.finish_reason is None:
                req.error = error
                req.changed.set()

"""Engine: the user-facing API — add_request / step / abort / generate, stats (validation, ids and
outputs: :mod:`hwkv.engine.tracking`).

Request flow: ``add_request`` validates and tokenizes → ``Scheduler.schedule`` picks tokens →
``ModelRunner.execute`` builds metadata, runs the model and the sampler → ``update_from_output``
appends tokens and applies token stop conditions → the detokenizer extends the text and checks
stop strings → ``RequestOutput``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from hwkv.connectors import connector_stats
from hwkv.core.request import RequestStatus
from hwkv.core.scheduler import Scheduler
from hwkv.engine.build import build_parts
from hwkv.engine.config import EngineArgs
from hwkv.engine.kv_events import KVEventPublisher, snapshot_events
from hwkv.engine.prompt import Prompt
from hwkv.engine.stats import EngineStats
from hwkv.engine.structured import StructuredOutputs
from hwkv.engine.tracking import LAST_UNFINISHED, RequestTracking, Tracked
from hwkv.outputs import RequestOutput

IDLE_WAIT_S = 0.0005  # a step that scheduled nothing while requests wait (for KV in flight) sleeps this long


class Engine(RequestTracking):
    """The inference engine: ``add_request`` / ``step`` / ``abort`` / ``generate`` over one model on
    one backend.

    Options are keyword-only, one group each (:mod:`hwkv.engine.config`: fields, defaults and checks;
    ``None`` lets the engine choose, once, in :meth:`EngineArgs.resolve
    <hwkv.engine.config.EngineArgs.resolve>`; the result is ``self.config``):

    * model — ``model``: a Hugging Face directory (config.json + safetensors); ``dtype``: weights and
      KV dtype (``None``/``"auto"``: the checkpoint's); ``max_model_len``: prompt + output tokens
      per request (``None``: the model's, capped by the KV pool); ``seed``: the global seed.
    * backend — ``backend``: a registered name (``hwkv backends``) or a Backend instance.
    * cache — ``block_size`` (``None``: the backend's default); ``num_kv_blocks`` (``None``: what
      ``memory_fraction`` of device memory leaves after the weights, capped at ``max_num_seqs``
      full-length requests); ``enable_prefix_caching``; ``kv_cache_dtype`` (``"auto"``: the model's
      dtype; ``"fp8"``: float8 e4m3 KV, half the bytes, where the backend declares it) and
      ``kv_cache_scales`` (its dequantisation scales: a float, ``[k, v]``, per layer or per layer and
      KV head; ``None``: 1.0) — docs/fp8-kv-cache.md.
    * scheduler — ``max_num_seqs``; ``max_num_batched_tokens`` (token budget per step; ``None``:
      2048, or ``max_model_len`` without chunked prefill); ``enable_chunked_prefill``;
      ``long_prefill_token_threshold``; ``max_num_partial_prefills``; ``scheduling_policy``
      (``"fcfs"``, or ``"priority"``: lower ``SamplingParams.priority`` first, preempting lower
      priority running requests); ``reserve_full_prompt`` (admit a request only when its whole
      prompt fits in free blocks, not just its first chunk).
    * runtime — ``enforce_eager`` (never capture graphs; graphs serve pure-decode steps where the
      backend declares ``Capabilities.graph_capture``); ``async_scheduling`` (plan step N+1 while
      N runs; ``None``: with graphs); ``fuse_elementwise`` (``None``: with graphs); ``decode_ops``
      (the backend's fused decode ops; ``None``: where offered, ``True``: required).
    * kv_transfer — ``kv_connector``: a registered connector name (``hwkv connectors``), a
      ``"package.module:Class"`` or an instance (``None``: none); ``kv_connector_config``: a named
      connector's keyword arguments. Graphs and async scheduling stay on (graphs go off only for a
      layerwise connector whose hooks cannot be captured). Stats in ``stats()["kv_connector"]``.
    * speculative — ``speculative_config``: ``{"method": "ngram" | "draft_model" | "eagle" | "eagle3",
      "num_speculative_tokens": k, ...}`` (:class:`hwkv.spec_decode.SpeculativeConfig`; a JSON object
      string is accepted too); turns async scheduling off. Stats in ``stats()["spec_decode"]``.
    * parallel — ``tensor_parallel_size``: shard the model over N devices, one worker process per
      rank beyond this one (docs/parallelism.md); ``close()`` stops the workers.
    """

    # parts, set by hwkv.engine.build.build_parts (the construction order lives there)
    backend: Any
    model: Any
    kv_cache: Any
    scheduler: Scheduler
    runner: Any
    connector: Any  # the KV connector, or None (hwkv.connectors.make_connector)
    proposer: Any
    config: Any
    _tp: Any

    def __init__(self, model: str, **options: Any):
        args = EngineArgs(model=str(model), **options)  # TypeError: an unknown option; ValueError: a bad value
        build_parts(self, args)  # hwkv/engine/build.py: the parts, in order
        self.runner.structured = StructuredOutputs(self.tokenizer, self.vocab_size, tuple(sorted(self.eos_token_ids)))
        self.kv_events = None  # KV events publisher (docs/kv-events.md), opt-in
        if args.kv_events_endpoint is not None:
            self._start_kv_events(args.kv_events_endpoint, args.kv_events_replay_endpoint)
        # Ids: the scheduler, runner and connector see internal ids "<request_id>-<n>", unique per
        # engine lifetime (as vLLM), so a reused request id can never meet its predecessor's state.
        self._tracked: dict[str, Tracked] = {}  # internal id -> state, until finished
        self._live: dict[str, str] = {}  # request id -> internal id, until finished
        self._pending: list[RequestOutput] = []  # final outputs (aborted, failed) the next step() returns
        self._inflight: Any = None  # async: the launched step whose tokens the next step() applies
        self._ids = itertools.count()  # generate()'s request ids
        self._seq = itertools.count()  # internal id suffixes
        self._stats = EngineStats()

    def close(self) -> None:
        """Stop what outlives the engine object: tensor-parallel workers (idempotent; also done when
        the engine is collected or the interpreter exits), the KV connector's threads and sockets,
        and the KV events publisher (what is queued is sent first, bounded), the grammar worker thread."""
        self.runner.structured.close()
        if self._tp is not None:
            self._tp.close()
        if self.connector is not None:
            self.connector.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    def _start_kv_events(self, endpoint: str, replay_endpoint: str | None) -> None:
        kv, conn = self.kv_cache_manager, self.connector
        kv.enable_kv_events()
        self._kv_event_sources = [kv]
        if conn is not None:
            conn.enable_kv_events()  # the connector's tiers (host offload, pool) report too
            self._kv_event_sources.append(conn)
        self._kv_snapshot = lambda: snapshot_events(kv, conn)
        self.kv_events = KVEventPublisher(endpoint, replay_endpoint)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: Any = None, priority: int = 0,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        """Validate and queue a request; on ``ValueError`` nothing is registered.

        ``request_id`` stays in use until ``step()`` returned the request's final output. ``priority``
        (lower runs first) needs ``scheduling_policy="priority"``. ``kv_transfer_params`` (or
        ``params.kv_transfer_params``) reach the KV connector as ``request.kv_transfer_params``."""
        self._check_priority(priority)
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be a dict or None, got {type(kv_transfer_params).__name__}")
        req, tracked = self._make_request(request_id, prompt, params)
        req.priority = priority
        if kv_transfer_params is not None:
            req.kv_transfer_params = kv_transfer_params
        self._track(req, tracked)
        self.scheduler.add_request(req)

    def abort(self, request_id: str | list[str]) -> None:
        """Stop requests; each one's final output (finish_reason "abort") comes from the next step().
        Unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        self._finish([self._live[i] for i in ids if i in self._live], RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending)

    # ---- stepping -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler + model step; outputs of every request that got a token (or finished).

        With async scheduling a step launches the next model step and then applies the tokens of
        the one before it, so its outputs are one step behind (the first call may return none).
        A step that could schedule nothing while requests wait only for KV transfers (a connector's
        loads or sends) sleeps ``IDLE_WAIT_S`` (0.5 ms) before returning, instead of letting a
        polling loop spin and keep the GIL from the transfer threads."""
        return self._step(stream=True)

    def _step(self, stream: bool) -> list[RequestOutput]:
        # generate() needs only finished outputs: building one per running request per step costs
        # milliseconds at a few hundred requests, as much as a GPU decode step.
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        idle = not so.total_num_scheduled_tokens and (
            self._inflight is None or not self._inflight.total_num_scheduled_tokens)
        prev_so, self._inflight = self._inflight, None
        try:
            if self.async_scheduling:
                ro = self.runner.execute_async(so)
                self._inflight, so = so, prev_so
            else:
                ro = self.runner.execute(so)
        except Exception as e:
            self._contain(so, prev_so, stream, e)  # raises unless the failure was one request's
            ro = None
        except BaseException:
            self._rollback(so, prev_so, stream)
            raise
        outputs = self._apply(so, ro, stream) if so is not None and ro is not None else []
        outputs, self._pending = self._pending + outputs, []
        if self.kv_events is not None:  # this step's cache changes, as one batch
            self.kv_events.publish_step(self._kv_event_sources, self._kv_snapshot)
        moved = ro is not None and ro.kv_connector_output is not None  # a load or send just ended
        if idle and not outputs and not moved and self.scheduler.has_unfinished_requests():
            # only KV transfers are pending: no busy spin that keeps the GIL from their threads
            time.sleep(IDLE_WAIT_S)
        self._stats.busy_s += time.perf_counter() - t0 if so is not None and so.total_num_scheduled_tokens else 0.0
        return outputs

    def _rollback(self, so: Any, prev_so: Any, stream: bool) -> None:
        """Leave no request half-advanced: the previous step's tokens are applied, this step's
        requests restart by recompute (their blocks freed). Seeded generators are kept, as on a
        preemption: a step fails before it samples, so a recomputed request draws what it would have."""
        if prev_so is not None and (prev := self.runner.flush()) is not None:
            self._pending.extend(self._apply(prev_so, prev, stream))
        for rid in self.scheduler.requeue(so):
            self.runner.preempt(rid)

    def _contain(self, so: Any, prev_so: Any, stream: bool, exc: Exception) -> None:
        """A step failed: roll it back. If it ran a single suspect (a request from an earlier
        failed step, run alone since), the failure is that request's: it finishes with
        finish_reason "error". Otherwise its requests become suspects and ``exc`` propagates."""
        self._rollback(so, prev_so, stream)
        ran = list(so.num_scheduled_tokens)
        if len(ran) == 1 and ran[0] in self.scheduler.suspects:
            self._finish(ran, RequestStatus.FINISHED_ERROR, f"{type(exc).__name__}: {exc}")
            return
        # (async: the rolled-back step may carry requests the previous step just finished)
        self.scheduler.suspects.update(r for r in ran if r in self.scheduler.requests)
        raise exc

    def _apply(self, so: Any, ro: Any, stream: bool) -> list[RequestOutput]:
        """Apply one step's tokens: scheduler state, stop strings, outputs (finished ones when not ``stream``).

        Per request this is the hot loop of a large batch (hundreds of requests every few ms): no
        property chains, the detokenizer only where a tokenizer is loaded, an output only where wanted."""
        self._stats.record_step(so, ro, self.scheduler.requests)
        outputs = []
        tracked, lps, output = self._tracked, ro.logprobs, self._output
        for rid, (a, recs) in (ro.prompt_logprobs or {}).items():  # positions: a recompute rewrites the same
            tr = tracked.get(rid)
            if tr is not None and tr.prompt_logprobs is not None:
                tr.prompt_logprobs[a : a + len(recs)] = recs
        for req in self.scheduler.update_from_output(so, ro):
            tr = tracked[req.request_id]
            toks = req.output_token_ids
            if tr.logprobs is not None and lps:
                tr.logprobs.extend(lps.get(req.request_id, ()))
            if tr.detok.tokenizer is not None:
                new = toks[tr.num_seen :]
                tr.num_seen = len(toks)
                try:
                    stop = tr.detok.add_tokens(new, len(toks) >= req.sampling_params.min_tokens)
                except Exception as e:  # this request's text cannot be decoded: it alone fails
                    stop, tr.error = None, f"detokenizing failed: {type(e).__name__}: {e}"
                    self._end(req, RequestStatus.FINISHED_ERROR)
                if stop is not None:
                    self._end(req, RequestStatus.FINISHED_STOPPED)
                    req.stop_reason = stop
            else:
                tr.num_seen = len(toks)
            finished = req.status > LAST_UNFINISHED
            if stream or finished:
                outputs.append(output(req, tr))
            if finished:
                self._untrack(req.request_id)
        return outputs

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: Any = None,
                 use_tqdm: bool = True, priority: int | list[int] = 0) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. All inputs are validated first (on any
        exception every id is rolled back). Only this call's requests' outputs are returned; those of
        requests added with ``add_request`` stay for ``step()``. A request whose execution failed
        comes back with ``finish_reason "error"``; a step failure not yet attributed to one request
        aborts this call's requests and propagates (docs/engine.md, Failure behaviour).
        ``priority``: one for all prompts or one per prompt (needs ``scheduling_policy="priority"``)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        if len(prios) != len(prompts):
            raise ValueError(f"priority has {len(prios)} entries for {len(prompts)} prompts")
        for prio in prios:
            self._check_priority(prio)
        reqs = []
        try:
            for prompt, params, prio in zip(prompts, params_list, prios):
                reqs.append(self._make_request(self._next_id(), prompt, params))
                reqs[-1][0].priority = prio
                self._track(*reqs[-1])  # reserve the id while the others validate
        except BaseException:
            for req, _ in reqs:
                self._untrack(req.request_id)
            raise
        for req, _ in reqs:
            self.scheduler.add_request(req)
        ids = [tr.request_id for _, tr in reqs]
        wanted, done = set(ids), {}
        others: list[RequestOutput] = []  # outputs of requests added via add_request: step() returns them
        bar = _progress(len(ids), use_tqdm)
        try:
            while len(done) < len(ids) and self.has_unfinished():
                for out in self._step(stream=False):
                    if out.request_id not in wanted:
                        others.append(out)
                    elif out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            self.abort([i for i in ids if i not in done])
            self._pending = [o for o in self._pending if o.request_id not in wanted]
            raise
        finally:
            self._pending.extend(others)
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        kv = self.kv_cache_manager
        out = self._stats.snapshot(
            kv_usage=kv.usage, num_kv_blocks=self.kv_cache.spec.num_blocks, num_free_blocks=kv.num_free_blocks,
            prefix_stats=kv.stats, num_preemptions=self.scheduler.num_preemptions,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
        )
        spec = self.config.speculative
        if spec is not None:
            out["spec_decode"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                                  **self.scheduler.spec_stats.snapshot(), "propose_s": self.runner.propose_s,
                                  "verify_graph_steps": self.runner.num_verify_graph_steps}
        if self.connector is not None:
            out["kv_connector"] = connector_stats(self.scheduler)
        if self.config.kv_groups:  # per KV-cache group (docs/hybrid-models.md): window None is full attention
            out["kv_groups"] = [{"window": g.window, "num_layers": len(g.layers),
                                 "num_blocks": m.block_pool.num_usable_blocks,
                                 "num_free_blocks": m.block_pool.num_free_blocks}
                                for g, m in zip(self.config.kv_groups, kv.managers)]
        return out


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)

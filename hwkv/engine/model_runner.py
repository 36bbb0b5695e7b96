"""ModelRunner: SchedulerOutput → step inputs → forward → sampled tokens.

Per-request state persists across steps in two host arrays indexed by a request's *slot*:
``token_ids[slot, :num_tokens]`` and ``block_table[slot, :num_blocks]``. A step's inputs are
built from them once, in bulk (:mod:`hwkv.engine.inputs`), and reach the device by one of two
routes: packed copies for an eager forward, or the static buffers of a captured graph for a
pure-decode step or a short-query step — a prompt's tail after a prefix hit, alone or beside decodes
(:meth:`enable_graphs`, :mod:`hwkv.engine.graph_runner`).

Everything device-specific goes through the backend's :class:`~hwkv.interfaces.device.Device`:
where its copies are asynchronous, inputs are staged in pinned memory and copied without
blocking, so the only host↔device synchronisation per step is reading the sampled tokens.

Async stepping: :meth:`execute_async` launches step N+1 *before* reading step N's tokens. Rows
whose input is step N's sampled token (not yet on the host) get it by a device-side copy from
N's token tensor; N's tokens are then read (by then the GPU has moved on to N+1's forward) and
recorded before N+1 is sampled, so the sampler always sees complete histories. :meth:`execute`
is ``execute_async`` + :meth:`flush`: the synchronous step, one code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from hwkv.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from hwkv.engine.graph_runner import SAMPLE_MAX_BATCH, GraphRunner, multi_token_graphs
from hwkv.engine.inputs import StepBatch, StepInputs, build_batch, group_inputs, to_device
from hwkv.engine.pending import EMPTY, Pending, fill_tokens
from hwkv.interfaces.connector import KVConnectorBase
from hwkv.model.sampler import SamplingBatch, argmax_rows, draw_uniforms, make_generator, sample_tokens


@dataclass
class _ReqState:
    slot: int
    num_tokens: int
    num_blocks: int
    num_prompt_tokens: int
    params: Any
    output_token_ids: list[int] = field(default_factory=list)
    # greedy, no penalties, no min_tokens, no logprobs: its token is the logits' argmax
    plain: bool = False


class ModelRunner:
    def __init__(self, model: Any, backend: Any, kv_cache: Any, block_size: int, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (), connector: KVConnectorBase | None = None):
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size, self.eos_token_ids = block_size, tuple(eos_token_ids)
        self.dev = backend.device
        self.device = self.dev.torch_device
        self.meta_builder = backend.attention.metadata_builder()
        self.connector = connector  # None: no connector (hwkv.connectors.make_connector)
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)  # widened per step
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        # KV-cache groups 1.. (hwkv.engine.kv_groups.GroupedKVCache): a block table each, rows as block_table's
        self.layer_group: list[int] | None = getattr(kv_cache, "layer_group", None)
        self.group_tables = [np.zeros_like(self.block_table) for _ in getattr(kv_cache, "groups", ())[1:]]
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.reqs: dict[str, _ReqState] = {}
        # Seeded requests' generators outlive a preemption (dropped only on finish), so a
        # preempted-and-recomputed request draws the same tokens as one that never was.
        self.generators: dict[str, torch.Generator] = {}
        self.graphs: GraphRunner | None = None
        self.graphs_b: GraphRunner | None = None  # the second set of small decode graphs (pingpong)
        self._copy_stream: Any = None  # pingpong's side streams: a steady step's inputs, tokens' read-back
        self._readback_stream: Any = None
        self.tail_graphs: GraphRunner | None = None  # short-query steps (enable_graphs)
        self.loading_tail_graphs: GraphRunner | None = None  # the same with per-layer load waits
        self.max_model_len = max_model_len
        self.num_graph_steps = 0  # pure-decode steps served by the graph path (stats / tests)
        self.num_graph_sampled_steps = 0  # of those, steps whose tokens are the graph's own greedy argmax
        # seconds the host waited for sampled tokens: a step's wall time less this is the host's own
        # work (`hwkv bench tp` holds the driver's at tp=2 against tp=1's)
        self.token_wait_s = 0.0
        self.num_tail_graph_steps = 0  # short-query steps (prefill tails, mixed with decodes) served by graphs
        self._pending: Pending | None = None  # the last launched step, until its output is returned
        self._num_special = 0  # requests held that are not ``plain`` (the sampler's fast path needs none)
        self._num_drops = 0  # requests dropped so far: a pending step whose count matches lost none
        self.structured: Any = None  # StructuredOutputs (hwkv.engine.structured), set by the engine
        if self.connector is not None:
            self.connector.bind_device(self.dev)
            self.connector.register_kv_caches(kv_cache)
            if self.connector.layerwise:  # per-layer load waits / saves inside the forward
                model.set_layer_hooks(self.connector)

    # short-query graphs: requests per step and query tokens per request (one KV block, capped) they serve
    TAIL_MAX_BATCH = 8
    TAIL_MAX_QUERY = 64

    def enable_graphs(self, max_batch: int, use_graphs: bool = True) -> None:
        """Serve pure-decode steps of up to ``max_batch`` requests from static buffers, captured as
        one device graph per bucket (``use_graphs=False``: the same path run eagerly, for tests); and,
        where the backend captures multi-token queries, steps of up to ``TAIL_MAX_BATCH`` requests of
        at most one block of query tokens each (a prompt's tail after a prefix hit, beside decodes)."""
        sample = self._greedy if self.samples_in_graphs else None
        self.graphs_b = None  # (enabled again: both sets anew)
        self.graphs = GraphRunner(self.model, self.kv_cache, self.meta_builder, self.dev, self.block_size,
                                  max_batch, self.max_model_len, use_graphs, sample=sample)
        if self.graphs.sample is not None and self.pingpong:  # a second set for every other steady step
            self.graphs_b = GraphRunner(self.model, self.kv_cache, self.meta_builder, self.dev, self.block_size,
                                        min(max_batch, SAMPLE_MAX_BATCH), self.max_model_len, use_graphs,
                                        sample=sample)
            self.graphs.feed(self.graphs_b)
            self.graphs_b.feed(self.graphs)
            self._copy_stream, self._readback_stream = self.dev.new_stream(), self.dev.new_stream()
        self.graphs.capture()
        if self.graphs_b is not None:
            self.graphs_b.capture(pool=self.graphs.pool)
        q = min(self.block_size, self.TAIL_MAX_QUERY, self.max_model_len)
        if self.serves_tail_graphs and q > 1 and multi_token_graphs(self.meta_builder):
            tail = partial(GraphRunner, self.model, self.kv_cache, self.meta_builder, self.dev, self.block_size,
                           min(max_batch, self.TAIL_MAX_BATCH), self.max_model_len, use_graphs, query_len=q,
                           last_only=True)
            self.tail_graphs = tail()
            self.tail_graphs.capture(pool=self.graphs.pool)
            if self.tail_graphs.hooks_left_out is not None:  # a tail right after a load: waits per layer
                self.loading_tail_graphs = tail(per_layer_hooks=True)
                self.loading_tail_graphs.capture(pool=self.graphs.pool)

    serves_tail_graphs = True  # a subclass whose step does not go through execute_async turns this off
    # small decode graphs also take the greedy argmax and feed it to the next step's inputs (graph_runner's
    # module doc); off in subclasses that sample otherwise (tensor parallel: the driver broadcasts) or step
    # synchronously (speculative decoding)
    samples_in_graphs = True
    # ... and take turns with a second set of those graphs and buffers, so that a steady step's inputs go over
    # while the previous step runs (graph_runner's module doc)
    pingpong = True
    serves_prompt_logprobs = True  # a subclass with its own execute_async turns this off (refused by name)

    # ---- persistent state ---------------------------------------------------------------------
    def _add(self, new: NewRequestData) -> None:
        self._drop(new.req_id)  # resumed after preemption: start over
        slot = self.free_slots.pop()
        toks = new.prompt_token_ids + new.output_token_ids
        self.token_ids[slot, : len(toks)] = toks
        self.block_table[slot, : len(new.block_ids)] = new.block_ids
        self.block_table[slot, len(new.block_ids) :] = 0  # clean padding, not a previous owner's blocks
        sp = new.sampling_params
        plain = sp.greedy and not sp.uses_penalties and not sp.min_tokens and sp.logprobs is None and not sp.logit_bias
        if sp.structured_outputs is not None:  # (re)started at the first output token: a fresh matcher
            self.structured.add(new.req_id, sp.structured_outputs, slot, new.output_token_ids)
        self.reqs[new.req_id] = _ReqState(slot, len(toks), len(new.block_ids), len(new.prompt_token_ids),
                                          sp, list(new.output_token_ids), plain)
        self._num_special += not plain
        if sp.seed is not None and new.req_id not in self.generators:
            self.generators[new.req_id] = make_generator(sp.seed, self.device)

    def release(self, req_id: str) -> None:
        """A request finished: drop its state (idempotent; the scheduler reports it again later)."""
        self._drop(req_id)
        self.generators.pop(req_id, None)

    def preempt(self, req_id: str) -> None:
        """A request will restart by recompute: drop its state, keep its seeded generator (idempotent)."""
        self._drop(req_id)

    def _drop(self, req_id: str) -> None:
        st = self.reqs.pop(req_id, None)
        if st is not None:
            if st.params.structured_outputs is not None:
                self.structured.drop(req_id)
            self.free_slots.append(st.slot)
            self._num_special -= not st.plain
            self._num_drops += 1

    def _append_blocks(self, st: _ReqState, block_ids: list[int]) -> None:
        n = len(block_ids)
        self.block_table[st.slot, st.num_blocks : st.num_blocks + n] = block_ids
        st.num_blocks += n

    def update_states(self, so: SchedulerOutput) -> list[_ReqState]:
        """Apply finished/preempted/new/cached changes; return states in batch order."""
        for rid in so.finished_req_ids:
            self.release(rid)
        for rid in so.preempted_req_ids:
            self._drop(rid)
        cached = so.scheduled_cached_reqs
        states = [self.reqs[rid] for rid in cached.req_ids]
        for st, blocks in zip(states, cached.new_block_ids):
            if blocks:
                self._append_blocks(st, blocks)
        for new in so.scheduled_new_reqs:
            self._add(new)
            states.append(self.reqs[new.req_id])
        if self.group_tables:
            self._group_blocks(so)
        return states

    def _group_blocks(self, so: SchedulerOutput) -> None:
        """Write KV-cache groups 1..'s block ids of this step (a new request's padding cleaned, as group 0's)."""
        new = {n.req_id for n in so.scheduled_new_reqs}
        for rid, per_group in so.group_block_ids.items():
            st = self.reqs[rid]
            for table, ids in zip(self.group_tables, per_group):
                table[st.slot, st.num_blocks - len(ids) : st.num_blocks] = ids
                if rid in new:
                    table[st.slot, st.num_blocks :] = 0

    # ---- one step -----------------------------------------------------------------------------
    def build_inputs(self, so: SchedulerOutput, states: list[_ReqState],
                     ahead: np.ndarray | None = None) -> StepBatch:
        """This step's host inputs (:func:`hwkv.engine.inputs.build_batch`); ``ahead[i]`` = 1 where
        row ``i``'s last token is still on the device (its input id is then a placeholder the
        caller fills in)."""
        R = len(states)
        ctx = np.array(so.scheduled_cached_reqs.num_computed_tokens
                       + [n.num_computed_tokens for n in so.scheduled_new_reqs], dtype=np.int64)
        ql = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=R)
        slots = np.fromiter((st.slot for st in states), dtype=np.int64, count=R)
        total = np.fromiter((st.num_tokens for st in states), dtype=np.int64, count=R)
        if ahead is not None:
            total += ahead
        batch = build_batch(self.token_ids, self.block_table, slots, ctx, ql, total, self.block_size)
        if self.group_tables:
            batch = batch._replace(groups=group_inputs(batch, self.group_tables, slots, self.block_size))
        return batch

    def device_inputs(self, batch: StepBatch) -> StepInputs:
        """The eager route of ``batch`` to the device, metadata built by the backend's builder."""
        return to_device(batch, self.dev, self.meta_builder, self.block_size, self.layer_group)

    def prepare_inputs(self, so: SchedulerOutput, states: list[_ReqState],
                       ahead: np.ndarray | None = None) -> StepInputs:
        """:meth:`build_inputs` + :meth:`device_inputs` (tests, benchmarks)."""
        return self.device_inputs(self.build_inputs(so, states, ahead))

    def record_sampled(self, states: list[_ReqState], toks: list[int]) -> None:
        """Append one sampled token per state (one bulk write into the token table)."""
        rows, cols = [], []
        for st, tok in zip(states, toks):
            rows.append(st.slot)
            cols.append(st.num_tokens)
            st.num_tokens += 1
            st.output_token_ids.append(tok)
        self.token_ids[rows, cols] = toks

    def _sampling_batch(self, states: list[_ReqState], req_ids: list[str]) -> SamplingBatch:
        params = [st.params for st in states]
        masked = self.structured is not None and self.structured.matchers
        if not self._num_special:  # every request held is plain: the sampler's argmax fast path
            mask = self.structured.bitmask(req_ids, [st.output_token_ids for st in states], self.dev,
                                           [st.slot for st in states]) if masked else None
            return SamplingBatch(params, [st.output_token_ids for st in states], plain=True, bitmask=mask)
        prompts = None
        if any(sp.repetition_penalty != 1.0 for sp in params):
            prompts = [self.token_ids[st.slot, : st.num_prompt_tokens].tolist() for st in states]
        gens = None
        if self.generators:
            gens = [self.generators.get(rid) for rid in req_ids]
        batch = SamplingBatch(params, [st.output_token_ids for st in states], prompts, gens,
                              eos_token_ids=self.eos_token_ids)
        if masked:
            # the draws first: the mask's worker fills beside their launches (per-row generators: two each)
            batch.uniforms = draw_uniforms(batch, self.device)
            batch.bitmask = self.structured.bitmask(req_ids, batch.output_token_ids, self.dev,
                                                    [st.slot for st in states])
        return batch

    def _graph_tokens_ok(self) -> bool:
        """Whether a graph step's tokens are the graph's own greedy argmax: every request held plain (the sampler's
        fast path) and no grammar mask (a tensor-parallel worker, whose requests carry no sampling parameters, takes
        the driver's word for it)."""
        return not self._num_special and not (self.structured is not None and self.structured.matchers)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampler's plain greedy tokens of ``logits`` (:func:`sample_tokens` with ``plain`` and no
        bitmask: the same functions), as captured in the decode graphs."""
        ops = getattr(self.model, "decode_ops", None)
        x = logits.float()
        tokens = ops.argmax(x) if ops is not None else None
        return tokens if tokens is not None else argmax_rows(x)

    def _sample(self, logits: torch.Tensor, states: list[_ReqState],
                req_ids: list[str]) -> tuple[torch.Tensor, Any]:
        """``(tokens [S] long on the device, logprobs or None)`` (tensor-parallel runners override:
        the driver samples and broadcasts, the workers receive)."""
        ops = getattr(self.model, "decode_ops", None)  # a backend's one-launch greedy argmax, where offered
        return sample_tokens(logits, self._sampling_batch(states, req_ids), ops.argmax if ops is not None else None)

    def _forward(self, inp: StepInputs) -> torch.Tensor:
        return self.model.forward(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata,
                                  inp.logits_indices, slot_mapping=inp.slot_mapping)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return its output (the synchronous step)."""
        if self._pending is not None:
            raise RuntimeError("execute() with an async step pending: flush() it first")
        self.execute_async(so)
        return self.flush()

    def flush(self) -> ModelRunnerOutput | None:
        """The pending step's output (reading its tokens if needed), or ``None`` when none is pending."""
        pend, self._pending = self._pending, None
        return None if pend is None else self._resolve(pend)

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch step ``so``, then return the *previous* step's output (``None`` if there was none).

        This step's output stays pending until the next call or :meth:`flush`. On an exception the
        previous step stays pending (``flush`` returns it) and this step left nothing behind."""
        pend = self._pending
        states = self.begin_step(so)
        if self.structured is not None:  # new requests' first masks, on the worker beside this forward
            self.structured.start_fresh()
        rows, src = pend.rows(states) if pend is not None else (EMPTY, EMPTY)
        ahead = None
        if len(rows):
            ahead = np.zeros(len(states), dtype=np.int64)
            ahead[rows] = 1
        # fill(input_ids, at=...) copies the unread tokens into the inputs on the device
        fill = partial(fill_tokens, src=src, tokens=pend.tokens, device=self.dev) if len(rows) else None  # type: ignore[union-attr]
        out, sampled, sampled_ids, logits = ModelRunnerOutput(), [], [], None
        plp, tokens, made_by = None, None, None
        if states:
            batch = self.build_inputs(so, states, ahead)
            req_ids = list(so.num_scheduled_tokens)
            if not batch.pure_decode:  # prompt tokens: a request may want their logprobs
                plp = self._prompt_logprob_rows(states, req_ids, batch)
            if plp is not None:  # eager, with logits for those prompt positions after the sampling rows
                inp = self.device_inputs(batch._replace(logits_indices=np.concatenate([batch.logits_indices, plp[0]])))
                if fill is not None:
                    fill(inp.input_ids, at=batch.query_start_loc[rows].astype(np.int64))
                logits = self._forward(inp)
                out.prompt_logprobs = self._prompt_logprobs(logits[len(batch.logits_indices):], plp[1])
                logits = logits[: len(batch.logits_indices)]
            elif self.graphs is not None and batch.pure_decode:
                gr, ready, side = self._decode_graphs(pend, len(states), rows, src)
                logits = gr.run(batch, partial(fill, at=rows) if fill else None, ids_ready=ready,  # type: ignore[union-attr]
                                copy_stream=side)
                self.num_graph_steps += logits is not None
                if logits is not None and gr.tokens is not None and self._graph_tokens_ok():
                    tokens, made_by = gr.tokens, gr  # every row plain greedy: the graph's argmax
                    self.num_graph_sampled_steps += 1
            elif self.tail_graphs is not None and batch.max_query_len <= self.tail_graphs.q:
                logits = self._run_tail(batch, fill, rows)
            if logits is None:
                inp = self.device_inputs(batch)
                if fill is not None:
                    fill(inp.input_ids, at=batch.query_start_loc[rows].astype(np.int64))
                logits = self._forward(inp)  # also when nothing samples: partial prefill chunks write KV
            if len(batch.sample_idx) == len(states):  # every row samples (decodes): no gather
                sampled, sampled_ids = states, req_ids
            else:
                idx = batch.sample_idx.tolist()
                sampled, sampled_ids = [states[i] for i in idx], [req_ids[i] for i in idx]
        prev = self._resolve(pend) if pend is not None else None
        if sampled:
            logprobs = None
            if tokens is None:
                tokens, logprobs = self._sample(logits, sampled, sampled_ids)
            if logprobs is not None:
                out.logprobs = {rid: [lp] for rid, lp in zip(sampled_ids, logprobs) if lp is not None}
            new = Pending(out, sampled, sampled_ids, tokens, num_drops=self._num_drops, made_by=made_by,
                          ids_in=None if made_by is None else made_by.feeds)
            if made_by is not None and made_by.feeds is not made_by:  # pingpong: read back beside the next step
                rb = self._readback_stream
                rb.wait_stream(self.dev.current_stream())
                with self.dev.stream_context(rb):
                    new.host, new.event = self.dev.to_host_async(tokens)
            else:
                new.host, new.event = self.dev.to_host_async(tokens)
            if self.structured is not None and self.structured.matchers:  # the next step's masks, overlapped
                self.structured.prefetch(sampled_ids, [st.slot for st in sampled],
                                         [len(st.output_token_ids) for st in sampled], new.host, new.event)
        else:
            new = Pending(out)
        self.finish_step(so, out)
        self._pending = new
        return prev

    def _decode_graphs(self, pend: Pending | None, n: int, rows: np.ndarray,
                       src: np.ndarray) -> tuple[GraphRunner, bool, Any]:
        """``(runner, ids_ready, copy stream)`` of a pure-decode step of ``n`` rows whose pending inputs are
        ``pend``'s tokens ``src`` at ``rows``. After a step whose graph took the greedy argmax, the runner
        whose ids row holds those tokens serves it where it can (with pingpong the other set: the replay just
        queued rewrites none of its buffers, and its own tokens stay untouched until read back); its ids are
        ready when the rows are the same requests in the same order, and then the other set's inputs go over
        on the side stream."""
        to = pend.ids_in if pend is not None else None
        if to is None or n > to.max_batch:
            return self.graphs, False, None  # type: ignore[return-value]
        ready = len(rows) == n and rows[-1] == n - 1 and np.array_equal(rows, src)
        return to, ready, self._copy_stream if ready and to is not pend.made_by else None  # type: ignore[union-attr]

    def _prompt_logprob_rows(self, states: list[_ReqState], req_ids: list[str],
                             batch: StepBatch) -> tuple[np.ndarray, list[tuple[str, int, int, int, int]]] | None:
        """Token rows of this step whose logits give prompt logprobs (position ``j`` predicts prompt
        token ``j + 1``), and per request ``(id, slot, first prompt index, count, top-n)``; ``None``
        when no request here wants them."""
        rows, reqs = [], []
        qsl = batch.query_start_loc
        for i, st in enumerate(states):
            k = st.params.prompt_logprobs
            if k is None:
                continue
            q0 = int(qsl[i])
            ctx = int(batch.positions[q0])
            n = min(int(qsl[i + 1]) - q0, st.num_prompt_tokens - 1 - ctx)
            if n > 0:
                rows.append(np.arange(q0, q0 + n, dtype=np.int64))
                reqs.append((req_ids[i], st.slot, ctx + 1, n, k))
        return (np.concatenate(rows), reqs) if reqs else None

    def _prompt_logprobs(self, logits: torch.Tensor,
                         reqs: list[tuple[str, int, int, int, int]]) -> dict[str, tuple[int, list[Any]]]:
        """Per request ``(first prompt index, records)``; a record is ``{token: (logprob, rank)}``: the
        prompt token's and the top-n (of the unmodified model distribution, as vLLM's)."""
        lp = logits.float().log_softmax(-1)
        target = np.concatenate([self.token_ids[slot, a : a + n] for _, slot, a, n, _ in reqs]).astype(np.int64)
        tgt = torch.from_numpy(target).to(lp.device)
        chosen = lp.gather(1, tgt.unsqueeze(1))
        rank = (lp > chosen).sum(-1) + 1
        k = max(r[4] for r in reqs)
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        chosen_l, rank_l, top_v, top_i = chosen.squeeze(1).tolist(), rank.tolist(), top_v.tolist(), top_i.tolist()
        out, row = {}, 0
        for rid, _, a, n, kk in reqs:
            recs = []
            for r in range(row, row + n):
                d = {t: (v, j + 1) for j, (t, v) in enumerate(zip(top_i[r][:kk], top_v[r][:kk]))}
                d.setdefault(int(target[r]), (chosen_l[r], rank_l[r]))
                recs.append(d)
            out[rid] = (a, recs)
            row += n
        return out

    # ---- the KV connector around a forward (every runner: plain, spec-decode, tensor-parallel) ----
    def begin_step(self, so: SchedulerOutput, start_loads: bool = True) -> list[Any]:
        """Apply ``so`` to the request states; the connector's metadata is bound before (if
        ``update_states`` fails, the next bind retires this step's jobs unissued, so no pin leaks) and
        its loads start after (unless ``start_loads`` is False: a step that will not run)."""
        conn = self.connector
        if conn is not None:
            conn.bind_connector_metadata(so.kv_connector_metadata)
        states = self.update_states(so)
        if conn is not None and start_loads:
            conn.start_load_kv()
        return states

    def finish_step(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """After the forward: the connector's saves are submitted and its completions go into ``out``."""
        if self.connector is not None:
            self.connector.wait_for_save()
            out.kv_connector_output = self.connector_finished(so)

    def _run_tail(self, batch: StepBatch, fill: Any, rows: np.ndarray) -> torch.Tensor | None:
        """Logits ``[S, vocab]`` of the sampling rows of a short-query step from the tail graphs, or
        ``None`` (the step runs eagerly)."""
        tg = self.tail_graphs
        if self.loading_tail_graphs is not None and self.connector.loads_layer_by_layer():  # type: ignore[union-attr]
            tg = self.loading_tail_graphs
        logits = tg.run(batch, partial(fill, at=rows * tg.q) if fill else None)  # type: ignore[union-attr]
        if logits is None:
            return None
        self.num_tail_graph_steps += 1
        if len(batch.sample_idx) < len(batch.seq_lens):  # rows of a partial prompt chunk sample nothing
            logits = logits.index_select(0, torch.from_numpy(batch.sample_idx).to(logits.device))
        return logits

    def connector_finished(self, so: SchedulerOutput) -> Any:
        """The connector's completions of this step; a request whose load failed loses its state here
        (the scheduler discards its token and it restarts by recompute)."""
        kvo = self.connector.get_finished(so.finished_req_ids)  # type: ignore[union-attr]
        if kvo is not None:
            for rid in kvo.failed_recving:
                self.preempt(rid)
        return kvo

    def _resolve(self, pend: Pending) -> ModelRunnerOutput:
        """Read ``pend``'s tokens (waiting for its step), record them for the requests still here."""
        if pend.tokens is not None:
            if pend.event is not None:
                t0 = time.perf_counter()
                pend.event.synchronize()
                self.token_wait_s += time.perf_counter() - t0
            toks = pend.host.tolist()  # type: ignore[union-attr]
            if pend.num_drops == self._num_drops:  # no request left since the launch: all still here
                self.record_sampled(pend.states, toks)
            else:
                live = [(st, t) for st, rid, t in zip(pend.states, pend.req_ids, toks) if self.reqs.get(rid) is st]
                if live:
                    self.record_sampled([st for st, _ in live], [t for _, t in live])
            pend.out.sampled_token_ids = {rid: [t] for rid, t in zip(pend.req_ids, toks)}
            pend.tokens = pend.host = pend.event = None
        return pend.out


"""Tensor-parallel model runners: the driver's (rank 0) and the workers'.

Every rank runs the same :class:`~hwkv.engine.model_runner.ModelRunner` code on the same scheduler
output, so each holds the same per-request state and block tables over its own KV cache shard and
replays the same graphs. The driver forwards each runner call to the workers before making it
itself; the collectives inside the forward keep the ranks in step. The logits are all-gathered,
identical on every rank. Where every request is plain (the sampler's argmax fast path: no
penalties, seeds, grammars or logprobs), every rank takes their argmax itself, the same tokens with
no collective and no host work for it; otherwise the driver samples and broadcasts the tokens. Either
way the workers' next inputs (async scheduling fills them on the device) match the driver's.

A KV connector's worker side runs on every rank over that rank's KV shard: the step's metadata
travels in ``Execute``, each worker reports its completions (``KVOut``) and the driver merges them
with its own (:class:`~hwkv.engine.tp.kv_output.KVOutputAggregator`) before the scheduler sees them.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

import msgspec
import torch

from hwkv.core.sched_output import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput
from hwkv.engine.model_runner import ModelRunner
from hwkv.engine.tp import messages as m
from hwkv.engine.tp.kv_output import KVOutputAggregator
from hwkv.sampling_params import SamplingParams


def encode_step(so: SchedulerOutput, forward: bool = True, step: int = 0, argmax: bool = False) -> m.Execute:
    meta = so.kv_connector_metadata
    c = so.scheduled_cached_reqs
    return m.Execute(
        [m.NewReq(n.req_id, list(n.prompt_token_ids), list(n.output_token_ids), list(n.block_ids),
                  n.num_computed_tokens) for n in so.scheduled_new_reqs],
        list(c.req_ids), list(c.new_block_ids), list(c.num_computed_tokens), list(so.num_scheduled_tokens.values()),
        so.total_num_scheduled_tokens, list(so.finished_req_ids), list(so.preempted_req_ids), forward, step,
        None if meta is None else msgspec.msgpack.encode(meta), argmax, so.group_block_ids,
    )


GRAPH_SAMPLE_ENV = "HWKV_TP_GRAPH_SAMPLE"


def graph_sample() -> bool:
    """Whether the small decode graphs of a tensor-parallel runner take the greedy argmax themselves and feed it to the
    next step's inputs, in two sets taking turns (``ModelRunner.samples_in_graphs``, ``pingpong``), as at one device:
    every rank replays the same graphs over the same all-gathered logits, so every rank's argmax is the same, and a
    step whose requests are all plain greedy (the driver's ``argmax`` word) takes it on every rank; other steps still
    sample on the driver and broadcast. ``HWKV_TP_GRAPH_SAMPLE=1``, read when the graphs are built (A/B)."""
    return os.environ.get(GRAPH_SAMPLE_ENV, "0") == "1"


def _hwkv_env(env: dict[str, str] | None) -> dict[str, str]:
    bad = [k for k in env or {} if not k.startswith("HWKV_")]
    if bad:
        raise ValueError(f"recapture sets HWKV_ variables only, not {bad}")
    return dict(env or {})


def recapture(runner: ModelRunner, lo: int, hi: int, env: dict[str, str] | None = None) -> int:
    """Set ``env`` (``HWKV_`` names only, so a message cannot steer anything else; an empty value unsets one),
    then capture ``runner``'s decode graphs of ``lo < batch <= hi`` again (``GraphRunner.capture`` of those keys,
    in every set of decode graphs it holds), so that tile or kernel choices read from the environment at launch
    take effect. Returns the graphs captured. A tensor-parallel driver does it on every rank
    (:meth:`DriverRunner.recapture`)."""
    for k, v in _hwkv_env(env).items():
        if v:
            os.environ[k] = v
        else:
            os.environ.pop(k, None)
    sets = [g for g in (runner.graphs, runner.graphs_b) if g is not None]
    if not sets:
        return 0
    keys = [sorted((k for k in g.graphs if lo < k[0] <= hi), reverse=True) for g in sets]
    sets[0].device.synchronize()
    # the old graphs go first, so that the new captures may reuse their memory in the shared pool
    old = [(g.graphs.pop(k), g.graph_tokens.pop(k, None)) for g, ks in zip(sets, keys) for k in ks]
    del old
    gc.collect()
    for g, ks in zip(sets, keys):
        if ks:
            g.capture(pool=sets[0].pool, batches={b for b, _ in ks})
    return sum(len(ks) for ks in keys)


_UNSAMPLED = SamplingParams()  # workers never sample: a placeholder (no seed: no generator)


def decode_step(e: m.Execute, metadata_type: Any = Any) -> SchedulerOutput:
    new = [NewRequestData(n.req_id, n.prompt_token_ids, n.output_token_ids, n.block_ids, n.num_computed_tokens,
                          _UNSAMPLED) for n in e.new]
    ids = e.cached_ids + [n.req_id for n in e.new]
    so = SchedulerOutput(new, CachedRequestData(e.cached_ids, e.cached_new_blocks, e.cached_computed),
                         dict(zip(ids, e.num_scheduled)), e.total, set(e.finished), set(e.preempted))
    if e.kv_meta is not None:
        so.kv_connector_metadata = msgspec.msgpack.decode(e.kv_meta, type=metadata_type)
    so.group_block_ids = e.groups
    return so


class DriverRunner(ModelRunner):
    """Rank 0: forwards every call to the workers (``executor.send``), then runs it."""

    serves_prompt_logprobs = False
    samples_in_graphs = property(lambda self: graph_sample())  # type: ignore[assignment]

    def __init__(self, *args: Any, executor: Any, fuse: bool, **kw: Any):
        super().__init__(*args, **kw)
        self.executor, self.comm = executor, executor.comm
        self.step_id = 0  # forward steps sent to the workers (their KVOut reports name it)
        self.argmax = False  # this step's tokens are the argmax on every rank (no broadcast)
        self.kv_outputs = KVOutputAggregator(executor.comm.world_size, self.connector) if self.connector else None
        self._kv_dec = msgspec.msgpack.Decoder(KVConnectorOutput)
        groups = [(list(g.layers), g.window, g.num_blocks) for g in getattr(self.kv_cache, "groups", ())]
        executor.send(m.Setup(self.token_ids.shape[0], self.max_model_len, fuse, groups))
        if self.connector is not None:
            dec = msgspec.msgpack.Decoder(self.connector.tp_worker_info_type)
            infos = [dec.decode(b) for b in executor.collect_info()]
            self.connector.bind_tp_worker_info([self.connector.tp_worker_info(), *infos])

    def enable_graphs(self, max_batch: int, use_graphs: bool = True) -> None:
        self.executor.send(m.Graphs(max_batch, use_graphs))  # capture runs collectives: all ranks at once
        super().enable_graphs(max_batch, use_graphs)

    def recapture(self, lo: int, hi: int, env: dict[str, str] | None = None) -> int:
        """:func:`recapture` on every rank (the workers first: the capture's collectives pair up)."""
        self.executor.send(m.Recapture(_hwkv_env(env), lo, hi))  # refused here before any rank changes
        return recapture(self, lo, hi, env)

    def update_states(self, so: SchedulerOutput) -> list[Any]:
        # The step goes to the workers only once the driver's own state changes succeeded: were it
        # sent first, a failure here (e.g. a seeded generator refused) would leave the workers
        # waiting in the forward's first collective until the timeout.
        try:
            states = super().update_states(so)
        except BaseException:
            self.executor.send(encode_step(so, forward=False))
            raise
        self.step_id += 1
        # plain argmax on every rank (the sampler's fast path; a grammar's bitmask is not on the workers)
        self.argmax = not self._num_special and (self.structured is None or not self.structured.matchers)
        self.executor.send(encode_step(so, step=self.step_id, argmax=self.argmax))
        return states

    def connector_finished(self, so: SchedulerOutput) -> Any:
        """Every rank's completions of this step merged (:mod:`hwkv.engine.tp.kv_output`); a load that
        failed drops the request's state on every rank (``preempt`` is forwarded)."""
        own = self.connector.get_finished(so.finished_req_ids)  # type: ignore[union-attr]
        outs = [(r.rank, None if r.output is None else self._kv_dec.decode(r.output))
                for r in self.executor.collect_kv(self.step_id)]
        kvo = self.kv_outputs.aggregate([(0, own), *outs], so.num_scheduled_tokens)  # type: ignore[union-attr]
        if kvo is not None:
            for rid in kvo.failed_recving:
                self.preempt(rid)
        return kvo

    def execute_async(self, so: SchedulerOutput) -> Any:
        try:
            return super().execute_async(so)
        except BaseException:
            self.executor.send(m.Rollback())
            raise

    def flush(self) -> Any:
        self.executor.send(m.Flush())
        return super().flush()

    def release(self, req_id: str) -> None:
        self.executor.send(m.Release(req_id))
        super().release(req_id)

    def preempt(self, req_id: str) -> None:
        self.executor.send(m.Preempt(req_id))
        super().preempt(req_id)

    def _sample(self, logits: torch.Tensor, states: list[Any], req_ids: list[str]) -> tuple[torch.Tensor, Any]:
        if self.argmax:  # the workers take the same argmax of the same logits
            return super()._sample(logits, states, req_ids)
        try:
            tokens, logprobs = super()._sample(logits, states, req_ids)
        except BaseException:  # the workers wait in the broadcast: release them (Rollback follows)
            self.comm.broadcast(torch.full((len(states),), -1, dtype=torch.long, device=self.device))
            raise
        tokens = tokens.long().contiguous()
        self.comm.broadcast(tokens)
        return tokens, logprobs


class WorkerRunner(ModelRunner):
    """Ranks > 0: the same steps, tokens received from the driver's broadcast."""

    serves_prompt_logprobs = False
    samples_in_graphs = property(lambda self: graph_sample())  # type: ignore[assignment]

    def __init__(self, *args: Any, comm: Any, report: Any = None, **kw: Any):
        super().__init__(*args, **kw)
        self.comm = comm
        self._before: Any = None
        self.report = report  # sends this rank's connector output of a step to the driver
        self.step_id = 0
        self.argmax = False  # the driver's word for this step: take the argmax here, no broadcast

    def connector_finished(self, so: SchedulerOutput) -> Any:
        # the driver merges every rank's output and forwards the preemptions a failed load needs
        self.report(self.step_id, self.connector.get_finished(so.finished_req_ids))  # type: ignore[union-attr, misc]
        return None

    def execute_async(self, so: SchedulerOutput, forward: bool = True) -> Any:
        self._before = self._pending
        if not forward:  # the driver failed in its update_states: mirror what it may have applied
            with contextlib.suppress(Exception):  # the driver raised too; the engine requeues the step
                self.begin_step(so, start_loads=False)
            return None
        return super().execute_async(so)

    def rollback(self) -> None:
        self._pending = self._before

    def _graph_tokens_ok(self) -> bool:
        return self.argmax  # the driver's word: its own test of every request plain and no grammar

    def _sample(self, logits: torch.Tensor, states: list[Any], req_ids: list[str]) -> tuple[torch.Tensor, Any]:
        if self.argmax:  # the driver's sampler fast path (the backend's one-launch argmax where offered), on the
            # same logits: torch's argmax of a 128,256-logit row took 27 us on an H200 against the driver's 3 us, and
            # the driver waited that out in the next step's first all-reduce (2 x H200, Llama-3-8B shape, batch 1)
            return self._greedy(logits), None
        tokens = torch.empty(len(states), dtype=torch.long, device=self.device)
        return self.comm.broadcast(tokens), None

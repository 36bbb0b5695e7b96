"""Tensor-parallel model runners: the driver's (rank 0) and the workers'.

Every rank runs the same :class:`~hwkv.engine.model_runner.ModelRunner` code on the same scheduler
output, so each holds the same per-request state and block tables over its own KV cache shard and
replays the same graphs. The driver forwards each runner call to the workers before making it
itself; the collectives inside the forward keep the ranks in step. Sampling happens once, on the
driver (the logits are all-gathered, identical on every rank); the tokens are broadcast, so the
workers' next inputs (async scheduling fills them on the device) match the driver's.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hwkv.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from hwkv.engine.model_runner import ModelRunner
from hwkv.parallel import messages as m
from hwkv.sampling_params import SamplingParams


def encode_step(so: SchedulerOutput, forward: bool = True) -> m.Execute:
    if so.kv_connector_metadata is not None:
        raise ValueError("tensor parallelism runs without a KV connector")
    c = so.scheduled_cached_reqs
    return m.Execute(
        [m.NewReq(n.req_id, list(n.prompt_token_ids), list(n.output_token_ids), list(n.block_ids),
                  n.num_computed_tokens) for n in so.scheduled_new_reqs],
        list(c.req_ids), list(c.new_block_ids), list(c.num_computed_tokens), list(so.num_scheduled_tokens.values()),
        so.total_num_scheduled_tokens, list(so.finished_req_ids), list(so.preempted_req_ids), forward,
    )


_UNSAMPLED = SamplingParams()  # workers never sample: a placeholder (no seed: no generator)


def decode_step(e: m.Execute) -> SchedulerOutput:
    new = [NewRequestData(n.req_id, n.prompt_token_ids, n.output_token_ids, n.block_ids, n.num_computed_tokens,
                          _UNSAMPLED) for n in e.new]
    ids = e.cached_ids + [n.req_id for n in e.new]
    return SchedulerOutput(new, CachedRequestData(e.cached_ids, e.cached_new_blocks, e.cached_computed),
                           dict(zip(ids, e.num_scheduled)), e.total, set(e.finished), set(e.preempted))


class DriverRunner(ModelRunner):
    """Rank 0: forwards every call to the workers (``executor.send``), then runs it."""

    def __init__(self, *args: Any, executor: Any, fuse: bool, **kw: Any):
        super().__init__(*args, **kw)
        self.executor, self.comm = executor, executor.comm
        executor.send(m.Setup(self.token_ids.shape[0], self.max_model_len, fuse))

    def enable_graphs(self, max_batch: int, use_graphs: bool = True) -> None:
        self.executor.send(m.Graphs(max_batch, use_graphs))  # capture runs collectives: all ranks at once
        super().enable_graphs(max_batch, use_graphs)

    def update_states(self, so: SchedulerOutput) -> list[Any]:
        # The step goes to the workers only once the driver's own state changes succeeded: were it
        # sent first, a failure here (e.g. a seeded generator refused) would leave the workers
        # waiting in the forward's first collective until the timeout.
        try:
            states = super().update_states(so)
        except BaseException:
            self.executor.send(encode_step(so, forward=False))
            raise
        self.executor.send(encode_step(so))
        return states

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

    def __init__(self, *args: Any, comm: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.comm = comm
        self._before: Any = None

    def execute_async(self, so: SchedulerOutput, forward: bool = True) -> Any:
        self._before = self._pending
        if not forward:  # the driver failed in its update_states: mirror what it may have applied
            with contextlib.suppress(Exception):  # the driver raised too; the engine requeues the step
                self.update_states(so)
            return None
        return super().execute_async(so)

    def rollback(self) -> None:
        self._pending = self._before

    def _sample(self, logits: torch.Tensor, states: list[Any], req_ids: list[str]) -> tuple[torch.Tensor, Any]:
        tokens = torch.empty(len(states), dtype=torch.long, device=self.device)
        return self.comm.broadcast(tokens), None

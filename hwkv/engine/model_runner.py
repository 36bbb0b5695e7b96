"""ModelRunner: SchedulerOutput → input tensors + AttentionMetadata → forward → sampled tokens.

Per-request state persists across steps in two host tensors indexed by a request's *slot*:
``token_ids[slot, :num_tokens]`` and ``block_table[slot, :num_blocks]``. A step gathers them in
bulk (no per-token Python loop): positions from the cumulative query lengths, input ids by one
indexed gather, block-table rows by one row gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hwkv.connectors.base import KVConnectorBase, NoOpConnector
from hwkv.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from hwkv.interfaces.attention import AttentionMetadata
from hwkv.model.sampler import SamplingBatch, make_generator, sample


@dataclass
class _ReqState:
    slot: int
    num_tokens: int
    num_blocks: int
    num_prompt_tokens: int
    params: Any
    output_token_ids: list[int] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: Any, backend: Any, kv_cache: Any, block_size: int, max_num_seqs: int,
                 max_model_len: int, eos_token_ids: tuple[int, ...] = (), connector: KVConnectorBase | None = None):
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size, self.eos_token_ids = block_size, tuple(eos_token_ids)
        self.device = backend.device.torch_device
        self.meta_builder = backend.attention.metadata_builder()
        self.connector = None if connector is None or type(connector) is NoOpConnector else connector
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = torch.zeros((max_num_seqs, max_model_len), dtype=torch.long)
        self.block_table = torch.zeros((max_num_seqs, max_blocks), dtype=torch.int32)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.reqs: dict[str, _ReqState] = {}
        # Seeded requests' generators outlive a preemption (dropped only on finish), so a
        # preempted-and-recomputed request draws the same tokens as one that never was.
        self.generators: dict[str, torch.Generator] = {}
        if self.connector is not None:
            self.connector.register_kv_caches(kv_cache)

    # ---- persistent state ---------------------------------------------------------------------
    def _add(self, new: NewRequestData) -> None:
        self._drop(new.req_id)  # resumed after preemption: start over
        slot = self.free_slots.pop()
        toks = new.prompt_token_ids + new.output_token_ids
        self.token_ids[slot, : len(toks)] = torch.as_tensor(toks, dtype=torch.long)
        self.block_table[slot, : len(new.block_ids)] = torch.as_tensor(new.block_ids, dtype=torch.int32)
        sp = new.sampling_params
        self.reqs[new.req_id] = _ReqState(slot, len(toks), len(new.block_ids), len(new.prompt_token_ids),
                                          sp, list(new.output_token_ids))
        if sp.seed is not None and new.req_id not in self.generators:
            self.generators[new.req_id] = make_generator(sp.seed, self.device)

    def release(self, req_id: str) -> None:
        """A request finished: drop its state (idempotent; the scheduler reports it again later)."""
        self._drop(req_id)
        self.generators.pop(req_id, None)

    def _drop(self, req_id: str) -> None:
        st = self.reqs.pop(req_id, None)
        if st is not None:
            self.free_slots.append(st.slot)

    def _append_blocks(self, st: _ReqState, block_ids: list[int]) -> None:
        n = len(block_ids)
        self.block_table[st.slot, st.num_blocks : st.num_blocks + n] = torch.as_tensor(block_ids, dtype=torch.int32)
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
        return states

    # ---- one step -----------------------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput, states: list[_ReqState]) -> tuple[Any, ...]:
        """input_ids, positions, backend metadata, logits_indices, indices of sampling requests."""
        num_computed = so.scheduled_cached_reqs.num_computed_tokens + [n.num_computed_tokens
                                                                       for n in so.scheduled_new_reqs]
        query_lens = list(so.num_scheduled_tokens.values())
        slots = torch.tensor([st.slot for st in states], dtype=torch.long)
        ql = torch.tensor(query_lens, dtype=torch.int32)
        ctx = torch.tensor(num_computed, dtype=torch.int32)
        seq_lens = ctx + ql
        num_tokens = torch.tensor([st.num_tokens for st in states], dtype=torch.int32)
        qsl = torch.cumsum(ql, 0)
        req_idx = torch.repeat_interleave(torch.arange(len(states)), ql.long())
        positions = torch.arange(int(qsl[-1])) - (qsl - ql).long()[req_idx] + ctx.long()[req_idx]
        input_ids = self.token_ids[slots[req_idx], positions]
        width = -(-int(seq_lens.max()) // self.block_size)
        block_table = self.block_table[slots, :width]
        common = AttentionMetadata.build(ql, seq_lens, block_table, self.block_size, self.device)
        attn_meta = self.meta_builder.build(common)
        sample_idx = torch.nonzero(seq_lens == num_tokens).flatten()
        logits_indices = (qsl - 1).long()[sample_idx]
        dev = self.device
        return (input_ids.to(dev), positions.to(dev), attn_meta, logits_indices.to(dev), sample_idx.tolist())

    def _sampling_batch(self, states: list[_ReqState], req_ids: list[str]) -> SamplingBatch:
        params = [st.params for st in states]
        prompts = None
        if any(sp.repetition_penalty != 1.0 for sp in params):
            prompts = [self.token_ids[st.slot, : st.num_prompt_tokens].tolist() for st in states]
        gens = None
        if self.generators:
            gens = [self.generators.get(rid) for rid in req_ids]
        return SamplingBatch(params, [st.output_token_ids for st in states], prompts, gens,
                             eos_token_ids=self.eos_token_ids)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        states = self.update_states(so)
        conn = self.connector
        if conn is not None:
            conn.bind_connector_metadata(so.kv_connector_metadata)
            conn.start_load_kv()
        out = ModelRunnerOutput()
        if states:
            input_ids, positions, attn_meta, logits_indices, sample_idx = self.prepare_inputs(so, states)
            req_ids = list(so.num_scheduled_tokens)
            if sample_idx:
                logits = self.model.forward(input_ids, positions, self.kv_cache, attn_meta, logits_indices)
                sampled = [states[i] for i in sample_idx]
                sampled_ids = [req_ids[i] for i in sample_idx]
                result = sample(logits, self._sampling_batch(sampled, sampled_ids))
                toks = result.token_ids
                slots = torch.tensor([st.slot for st in sampled], dtype=torch.long)
                cols = torch.tensor([st.num_tokens for st in sampled], dtype=torch.long)
                self.token_ids[slots, cols] = torch.tensor(toks, dtype=torch.long)
                for st, tok in zip(sampled, toks):
                    st.num_tokens += 1
                    st.output_token_ids.append(tok)
                out.sampled_token_ids = {rid: [t] for rid, t in zip(sampled_ids, toks)}
                if result.logprobs is not None:
                    out.logprobs = {rid: [lp] for rid, lp in zip(sampled_ids, result.logprobs) if lp is not None}
            else:  # only partial prefill chunks: write their KV, sample nothing
                self.model.forward(input_ids, positions, self.kv_cache, attn_meta, logits_indices)
        if conn is not None:
            conn.wait_for_save()
            out.kv_connector_output = conn.get_finished(so.finished_req_ids)
        return out

"""SpecModelRunner: the model runner's step with draft verification and proposing.

One step (synchronous; async stepping is off with speculative decoding):

1. The scheduled drafts (``SchedulerOutput.scheduled_spec_decode_tokens``) are written into the
   request's token row after its last known token, and the request's query covers them: a request
   with ``k`` drafts runs ``k + 1`` query tokens on its cached prefix (to the attention backend a
   short prefill chunk).
2. The target's logits at those ``k + 1`` positions go to the rejection sampler
   (:mod:`hwkv.spec_decode.rejection`), which returns the accepted drafts plus one token. When every
   request is plain greedy (no penalties, ``min_tokens`` or logprobs) that is one argmax per logits
   row read back and compared with the drafts on the host
   (:func:`~hwkv.spec_decode.rejection.greedy_verify`); otherwise the device sampler runs without
   host synchronisation and its tokens and counts come back in one transfer. Either way: one host
   read per step.
3. The emitted tokens are recorded (accepted drafts are already in the token row), and the
   proposer drafts up to ``k`` tokens for each request that sampled; they travel back in
   ``ModelRunnerOutput.spec_token_ids`` and the scheduler schedules them next step.

The scheduler rolls back ``num_computed_tokens`` past the rejected drafts, so their KV slots are
rewritten before anything reads them.

Graphs (where the engine captures them): steps without any draft that are pure decodes replay the
decode graphs; *pure verify* steps — every request decodes its last token plus ``0..k`` drafts
(``k`` = ``num_speculative_tokens``) and samples — replay verify graphs captured per (batch bucket,
seq-len bound) at query length ``k + 1`` (:class:`~hwkv.engine.graph_runner.GraphRunner` with
``query_len``), rows with fewer drafts padded (:func:`~hwkv.engine.graph_runner.pad_queries`; a verify
step of cached requests builds that padded batch straight from the tables,
:mod:`hwkv.spec_decode.verify_inputs`). The
rejection sampler runs after the replay on the graph's logits (its result is read back to the
host, so it stays outside the graph); on the greedy path the padded rows' argmax is simply ignored.
With an EAGLE proposer both kinds of graphs also return the target's states
(:class:`~hwkv.spec_decode.state_graphs.StatesGraphRunner`). Mixed steps (a request prefilling) run
eagerly.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
import torch

from hwkv.core.sched_output import ModelRunnerOutput, SchedulerOutput
from hwkv.engine.graph_runner import GraphRunner, multi_token_graphs, pad_queries
from hwkv.engine.inputs import group_inputs
from hwkv.engine.model_runner import ModelRunner
from hwkv.engine.spec_config import SpeculativeConfig
from hwkv.model.sampler import logprobs_of
from hwkv.spec_decode.proposer import Proposer, RunnerView
from hwkv.spec_decode.rejection import greedy_accept, greedy_verify, verify_packed
from hwkv.spec_decode.state_graphs import StatesGraphRunner, split
from hwkv.spec_decode.verify_inputs import verify_batch, verify_batch_rows

SMALL_BATCH = 32  # greedy verification up to this many sampling requests: plain Python per row
SMALL_VERIFY_ROWS = 4  # verify inputs of up to this many requests: built row by row (verify_batch_rows)


class SpecModelRunner(ModelRunner):
    serves_tail_graphs = False  # its steps do not run through execute_async
    samples_in_graphs = False  # verify steps sample outside the graphs
    serves_prompt_logprobs = False

    def __init__(self, *args: Any, spec_config: SpeculativeConfig, proposer: Proposer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.spec_config = spec_config
        self.proposer = proposer
        self.view = RunnerView(self)  # what the proposer reads of this runner
        self.propose_s = 0.0  # wall time spent proposing (host-synchronised: drafts are read back)
        self.verify_graphs: GraphRunner | None = None
        self.num_verify_graph_steps = 0  # pure-verify steps served by the verify graphs

    def enable_graphs(self, max_batch: int, use_graphs: bool = True) -> None:
        args = (self.model, self.kv_cache, self.meta_builder, self.dev, self.block_size, max_batch,
                self.max_model_len, use_graphs)
        if self.proposer.needs_hidden:  # EAGLE: the graphs return the target's states too
            cls: Any = partial(StatesGraphRunner, states=self.proposer.target_states)
            self.graphs = cls(*args)
            self.graphs.capture()
        else:
            cls = GraphRunner
            super().enable_graphs(max_batch, use_graphs)
        if multi_token_graphs(self.meta_builder):
            self.verify_graphs = cls(*args, query_len=self.spec_config.num_speculative_tokens + 1)
            self.verify_graphs.capture(pool=self.graphs.pool)  # type: ignore[union-attr]
        self.proposer.enable_graphs(self.view, max_batch, use_graphs)  # e.g. a draft model's one-token steps

    def _drop(self, req_id: str) -> None:
        super()._drop(req_id)
        self.proposer.drop(req_id)

    def execute_async(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        raise RuntimeError("speculative decoding runs synchronously (async_scheduling is off)")

    def flush(self) -> ModelRunnerOutput | None:
        return None

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        states = self.begin_step(so)
        out = ModelRunnerOutput(spec_token_ids={})
        if states:
            self._step(so, states, out)
        self.finish_step(so, out)
        return out

    def _step(self, so: SchedulerOutput, states: list[Any], out: ModelRunnerOutput) -> None:
        req_ids = list(so.num_scheduled_tokens)
        R = len(states)
        spec = so.scheduled_spec_decode_tokens
        drafts: list[Any] = [spec.get(rid, ()) for rid in req_ids] if spec else [()] * R
        ks = np.fromiter(map(len, drafts), dtype=np.int64, count=R)
        if spec:
            for st, d in zip(states, drafts):
                if d:
                    self.token_ids[st.slot, st.num_tokens : st.num_tokens + len(d)] = d
        logits = hidden = None
        q = 0  # > 0: logits are the verify graphs' q rows per request (padded rows included)
        eagle = self.proposer.needs_hidden  # the proposer reads the target's states
        vg = self.verify_graphs
        vb = None if vg is None or eagle or not spec else self._verify_inputs(so, states, drafts, ks, vg.q)
        if vb is not None:  # the steady state: the padded batch straight from the tables
            logits = vg.run(vb)  # type: ignore[union-attr]
        if logits is not None:
            batch, q = vb, vg.q  # type: ignore[union-attr]
            self.num_verify_graph_steps += 1
        else:
            batch = self.build_inputs(so, states, ks)  # a row samples when it reaches its last draft
            if vb is None:  # (vb given: a verify step the graphs cannot serve; it runs eagerly)
                logits, q = self._replay(batch, ks)
        sample_idx = batch.sample_idx
        if logits is not None and eagle:  # logits | states, the states of every (padded) query token
            logits, hidden = split(logits, self.model.config.vocab_size, self.model.dtype)
            if q:  # the real tokens' states, in the batch's order
                ql = np.diff(batch.query_start_loc).astype(np.int64)
                real = np.repeat(np.arange(R) * q, ql) + _ranges(ql)
                hidden = hidden.index_select(0, self.dev.to_device(torch.from_numpy(real)))
        if logits is None:
            if ks.any():
                k_s = ks[sample_idx]
                # k + 1 logits per sampling row: its last k + 1 query tokens
                first = np.repeat(batch.logits_indices - k_s, k_s + 1)
                batch = batch._replace(logits_indices=first + _ranges(k_s + 1))
            inp = self.device_inputs(batch)
            if eagle:
                h = self.model.forward_hidden(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata,
                                              inp.slot_mapping)
                logits = self.model.compute_logits(h, inp.logits_indices)
                hidden = self.proposer.target_states(self.model, h)
            else:
                logits = self._forward(inp)
        if not len(sample_idx):
            if eagle:  # prefill chunks: the head consumes their states now
                self.proposer.propose_with_hidden(self.view, states, batch, hidden, np.diff(batch.query_start_loc),
                                                  sample_idx, [])
            return
        if len(sample_idx) == R:  # every row samples (decodes and verifies): no gather
            sampled, sampled_ids, sdrafts, k_s = states, req_ids, drafts, ks
        else:
            idx = sample_idx.tolist()
            sampled, sampled_ids = [states[i] for i in idx], [req_ids[i] for i in idx]
            sdrafts, k_s = [drafts[i] for i in idx], ks[sample_idx]
        emitted = self._verify(logits, q, sampled, sampled_ids, sdrafts, k_s, out)
        out.sampled_token_ids = dict(zip(sampled_ids, emitted))
        # Accepted drafts are in the token rows already: each row's last token is written. Plain Python per
        # row: at the batch sizes speculation serves, cheaper than the numpy calls of a vectorised form.
        tid, k, max_len = self.token_ids, self.spec_config.num_speculative_tokens, self.max_model_len
        caps = []  # drafts worth proposing: a step emits at most drafts + 1 tokens, never past
        for st, em in zip(sampled, emitted):  # max_tokens or the model length (where the token row ends)
            n = st.num_tokens + len(em)
            tid[st.slot, n - 1] = em[-1]
            st.num_tokens = n
            outs = st.output_token_ids
            outs.extend(em)
            caps.append(max(min(st.params.max_tokens - len(outs), max_len - n, k + 1) - 1, 0))
        t0 = time.perf_counter()
        if eagle:
            valid = np.diff(batch.query_start_loc).astype(np.int64)
            valid[sample_idx] -= k_s + 1 - np.fromiter(map(len, emitted), np.int64, len(emitted))  # rejected drafts
            proposals = self.proposer.propose_with_hidden(self.view, states, batch, hidden, valid, sample_idx, caps)
        else:
            proposals = self.proposer.propose(self.view, sampled, sampled_ids, caps)
        self.propose_s += time.perf_counter() - t0
        out.spec_token_ids = {rid: p for rid, p in zip(sampled_ids, proposals) if p}

    def _verify(self, logits: torch.Tensor, q: int, sampled: list[Any], sampled_ids: list[str],
                drafts: list[Any], ks: np.ndarray, out: ModelRunnerOutput) -> list[list[int]]:
        """Each sampled request's emitted tokens (its accepted drafts, then one token) from the rejection
        sampler (:mod:`~hwkv.spec_decode.rejection`), read back in one transfer. ``logits``: ``q`` rows per
        request (verify graphs, ``q > 0``), or each request's ``k + 1`` rows consecutive (``q == 0``)."""
        S, K = len(ks), int(ks.max(initial=0))
        if not self._num_special:  # all greedy, no penalties / min_tokens / logprobs: argmax per row, compared here
            top_dev = logits.argmax(-1)
            if S <= SMALL_BATCH:  # plain Python per row
                top = top_dev.cpu().numpy()
                if q:
                    return greedy_accept(top.reshape(S, q).tolist(), drafts)
                flat, ends = top.tolist(), np.cumsum(ks + 1).tolist()
                return greedy_accept([flat[e - k - 1 : e] for e, k in zip(ends, ks.tolist())], drafts)
            # the host lays out the drafts while the device still runs the forward, then reads
            d2d = np.full((S, K), -1, dtype=np.int64)
            if K:
                d2d[np.arange(K) < ks[:, None]] = [t for d in drafts for t in d]
            top = top_dev.cpu().numpy()
            if q:
                top2d = top.reshape(S, q)[:, : K + 1]
            else:
                top2d = np.zeros((S, K + 1), dtype=top.dtype)
                top2d[np.arange(K + 1) <= ks[:, None]] = top
            toks, num = greedy_verify(top2d, d2d, ks)
            return [t[:n] for t, n in zip(toks.tolist(), num.tolist())]
        sbatch = self._sampling_batch(sampled, sampled_ids)
        if q and (ks != q - 1).any():  # rows with fewer drafts: their k + 1 logits only
            keep = np.repeat(np.arange(S) * q, ks + 1) + _ranges(ks + 1)
            logits = logits.index_select(0, self.dev.to_device(torch.from_numpy(keep)))
        sdrafts = [list(d) for d in drafts]
        res = verify_packed(logits, sdrafts, sbatch, device=self.dev).cpu().numpy()
        emitted = [t[:n] for t, n in zip(res[:, :-1].tolist(), res[:, -1].tolist())]
        if any(sp.logprobs is not None for sp in sbatch.params):
            out.logprobs = self._logprobs(logits, sdrafts, emitted, sbatch.params, sampled_ids)
        return emitted

    def _replay(self, batch: Any, ks: np.ndarray) -> tuple[torch.Tensor | None, int]:
        """``(logits, q)`` of a graph replay of ``batch`` (a pure decode, or a pure verify padded to ``q``
        query tokens per row: ``q`` logits rows per request), or ``(None, 0)`` (run it eagerly)."""
        if self.graphs is not None and not ks.any() and batch.pure_decode:
            logits = self.graphs.run(batch)
            self.num_graph_steps += logits is not None
            return logits, 0
        vg = self.verify_graphs
        if vg is not None and self._pure_verify(batch, ks):
            logits = vg.run(pad_queries(batch, vg.q, self.block_size))  # all q logits of every row
            if logits is not None:
                self.num_verify_graph_steps += 1
                return logits, vg.q
        return None, 0

    def _verify_inputs(self, so: SchedulerOutput, states: list[Any], drafts: list[Any], ks: np.ndarray,
                       q: int) -> Any:
        """The verify graphs' padded batch (:func:`~hwkv.spec_decode.verify_inputs.verify_batch`) when every
        request is a cached one that runs its last token and ``k < q`` drafts and samples; else ``None``."""
        if so.scheduled_new_reqs:
            return None
        ctx = so.scheduled_cached_reqs.num_computed_tokens
        for st, c, n, d in zip(states, ctx, so.num_scheduled_tokens.values(), drafts):  # one pass, no numpy calls
            if n != len(d) + 1 or n > q or c + 1 != st.num_tokens:
                return None
        if len(states) <= SMALL_VERIFY_ROWS and not self.group_tables:
            return verify_batch_rows(self.token_ids, self.block_table, [st.slot for st in states], ctx,
                                     [len(d) for d in drafts], q, self.block_size)
        slots = np.fromiter((st.slot for st in states), dtype=np.int64, count=len(states))
        batch = verify_batch(self.token_ids, self.block_table, slots, np.array(ctx, dtype=np.int64), ks, q,
                             self.block_size)
        if self.group_tables:  # KV-cache groups 1..: their tables and slots, padding as group 0's
            batch = batch._replace(groups=group_inputs(batch, self.group_tables, slots, self.block_size))
        return batch

    def _pure_verify(self, batch: Any, ks: np.ndarray) -> bool:
        """Every request decodes: runs its last token and its drafts (at most the verify graphs' ``k``),
        and samples; rows with fewer drafts are padded to ``k + 1`` tokens (:func:`pad_queries`)."""
        n, q = len(ks), self.verify_graphs.q  # type: ignore[union-attr]
        return (bool(ks.max(initial=0) < q) and len(batch.input_ids) == n + int(ks.sum())
                and len(batch.sample_idx) == n)

    @staticmethod
    def _logprobs(logits: torch.Tensor, drafts: list[list[int]], emitted: list[list[int]], params: list[Any],
                  req_ids: list[str]) -> dict[str, Any]:
        """One logprob record per emitted token, from the raw target logits of its position."""
        starts = np.cumsum([0] + [len(d) + 1 for d in drafts])[:-1]
        rows, toks, ps, owner = [], [], [], []
        for r, (s, em) in enumerate(zip(starts, emitted)):
            if params[r].logprobs is None:
                continue
            rows += range(int(s), int(s) + len(em))
            toks += em
            ps += [params[r]] * len(em)
            owner += [req_ids[r]] * len(em)
        if not rows:
            return {}
        idx = torch.tensor(rows, device=logits.device)
        lps = logprobs_of(logits.index_select(0, idx), torch.tensor(toks, device=logits.device), ps)
        result: dict[str, Any] = {}
        for rid, lp in zip(owner, lps):
            result.setdefault(rid, []).append(lp)
        return result


def _ranges(lens: np.ndarray) -> np.ndarray:
    """``0..lens[i]-1`` for every ``i``, concatenated."""
    return np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)

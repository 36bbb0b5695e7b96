"""Draft-model proposer: a smaller model of the target's vocabulary drafts greedily.

The draft model has its own paged KV cache with as many blocks as the target's, indexed by the
*same* block ids, so it reads the runner's block table and token rows and needs no bookkeeping of
its own beyond one number per request: how many leading positions of the draft cache hold KV of the
request's current tokens. Per step, for every request that sampled:

1. catch up: one forward over the positions the draft has not seen (the whole sequence for a new or
   resumed request, else the tokens accepted since the last step) → draft token 1;
2. ``k - 1`` single-token forwards, each feeding back the previous draft (batched over requests).

Graphs (where the target has them): the one-token forwards replay the draft's decode graphs. In steady
state a catch-up is 2 tokens (every draft accepted: the last draft, never fed, and the bonus token) or
1 (a draft rejected); a request with 1 to catch up re-feeds its last seen position as well, so every
steady-state catch-up is 2 tokens per request and replays the draft's 2-token graphs (rewriting that
position's KV from the same tokens; at worst a rounding difference, which only changes proposals).

Drafts are the draft model's argmax, so the rejection sampler treats them as deterministic
(one-hot draft distribution): exact for every sampling setting of the target. The KV written for
drafts that the target later rejects is simply not counted (the prefix check in ``_seen``), and the
scheduler holds ``k`` lookahead slots so the drafts' KV always has a block to land in. A draft's KV
only ever affects which tokens are proposed, never what is emitted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hwkv.engine.graph_runner import GraphRunner, multi_token_graphs
from hwkv.engine.inputs import build_batch
from hwkv.engine.kv_alloc import check_backend
from hwkv.engine.spec_config import ProposerTarget, SpeculativeConfig
from hwkv.model import load_model
from hwkv.spec_decode.proposer import Proposer, RunnerView

CATCH_UP_CHUNK = 2048  # tokens per request per catch-up forward of the draft


class DraftModelProposer(Proposer):
    def __init__(self, model: Any, backend: Any, k: int):
        self.model, self.backend, self.k = model, backend, k
        self.kv_cache: Any = None
        # req_id -> (num_tokens when it proposed, its drafts): what its draft KV was computed with
        self._last: dict[str, tuple[int, list[int]]] = {}
        self.graphs: Any = None  # the draft's own decode graphs (enable_graphs), where the target has them
        self.catchup_graphs: Any = None  # and its 2-token catch-up graphs
        self.num_graph_steps = 0

    @classmethod
    def load(cls, cfg: SpeculativeConfig, target: ProposerTarget) -> DraftModelProposer:
        model, mc, _, _ = load_model(cfg.model, target.backend, dtype=target.model.dtype, load_tokenizer=False)
        vt = target.model_config.vocab_size
        if mc.vocab_size != vt:
            raise ValueError(f"draft model {cfg.model} has vocab_size {mc.vocab_size}, the target {vt} "
                             "(allowed: a draft model with the target's vocabulary)")
        return cls(model, target.backend, cfg.num_speculative_tokens)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.model.kv_cache_spec(1, block_size).bytes_per_block

    def allocate(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if self.model.config.max_model_len < max_model_len:
            raise ValueError(f"draft model's max length {self.model.config.max_model_len} is shorter than the "
                             f"engine's max_model_len {max_model_len} (allowed: lower max_model_len)")
        check_backend(self.backend, self.model, block_size)
        spec = self.model.kv_cache_spec(num_blocks, block_size)
        self.kv_cache = self.backend.device.allocate_kv_cache(spec, self.backend.attention.kv_layout)

    def set_decode_ops(self, ops: Any) -> None:
        """The backend's fused decode ops for the draft's few-token forwards; a draft they cannot
        serve runs without them."""
        try:
            self.model.set_decode_ops(ops, self.kv_cache.spec.dtype)
        except ValueError:
            self.model.set_decode_ops(None)

    def enable_graphs(self, runner: RunnerView, max_batch: int, use_graphs: bool = True) -> None:
        """Serve the one-token draft steps (every draft after the first) from captured graphs of the
        draft model, bucketed like the target's (``use_graphs=False``: the same path run eagerly)."""
        args = (self.model, self.kv_cache, runner.meta_builder, runner.dev, runner.block_size, max_batch,
                runner.max_model_len, use_graphs)
        self.graphs = GraphRunner(*args)
        self.graphs.capture()
        if multi_token_graphs(runner.meta_builder):
            self.catchup_graphs = GraphRunner(*args, query_len=2)
            self.catchup_graphs.capture(pool=self.graphs.pool)

    def drop(self, req_id: str) -> None:
        self._last.pop(req_id, None)

    def _seen(self, runner: Any, rid: str, st: Any) -> int:
        """Leading positions whose draft KV matches the request's tokens now (at most all but the
        last token: the last must be fed to get the next draft's logits)."""
        last = self._last.get(rid)
        if last is None:
            return 0
        nt, drafts = last
        fed = np.asarray(drafts[:-1])  # the last draft was never fed back
        eq = runner.token_ids[st.slot, nt : min(nt + len(fed), st.num_tokens)] == fed[: max(st.num_tokens - nt, 0)]
        m = len(eq) if eq.all() else int(np.argmin(eq))
        return min(nt + m, st.num_tokens - 1)

    @torch.inference_mode()
    def propose(self, runner: RunnerView, states: list[Any], req_ids: list[str], caps: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in states]
        rows = [i for i, c in enumerate(caps) if c > 0]
        for rid, c in zip(req_ids, caps):
            if c <= 0:
                self._last.pop(rid, None)
        if not rows:
            return out
        slots = np.array([states[i].slot for i in rows], dtype=np.int64)
        total = np.array([states[i].num_tokens for i in rows], dtype=np.int64)
        ctx = np.array([self._seen(runner, req_ids[i], states[i]) for i in rows], dtype=np.int64)
        if self.catchup_graphs is not None:  # one token to catch up: feed two, the 2-token graphs serve it
            ctx -= (total - ctx == 1) & (ctx > 0)
        dev = runner.dev
        first: torch.Tensor | None = None  # draft 1 of every row, on the device
        while (left := total - ctx).any():  # catch up in pieces: a resumed long prompt is one big prefill
            live = np.flatnonzero(left > 0)
            q = np.minimum(left[live], CATCH_UP_CHUNK)
            t = self._forward(runner, slots[live], ctx[live], q)  # the last piece's token counts
            if len(live) == len(rows):  # the first piece: every row has at least its last token to feed
                first = t
            else:
                first = first.index_copy(0, dev.to_device(torch.from_numpy(live)), t)  # type: ignore[union-attr]
            ctx[live] += q
        cap = np.array([caps[i] for i in rows])
        drafts = [first]
        for j in range(1, int(cap.max())):  # draft j + 1: feed draft j, straight from the device
            live = np.flatnonzero(cap > j)
            live_t = None if len(live) == len(rows) else dev.to_device(torch.from_numpy(live))
            prev = drafts[-1] if live_t is None else drafts[-1].index_select(0, live_t)  # type: ignore[union-attr]
            nxt = self._forward(runner, slots[live], total[live] + j - 1, np.ones(len(live), dtype=np.int64), prev)
            drafts.append(nxt if live_t is None else torch.zeros_like(first).index_copy(0, live_t, nxt))
        d = torch.stack(drafts, 1).cpu().numpy()  # type: ignore[arg-type]  # the one host read of the drafts
        for r, i in enumerate(rows):
            out[i] = d[r, : caps[i]].tolist()
            self._last[req_ids[i]] = (int(total[r]), out[i])
        return out

    def _forward(self, runner: RunnerView, slots: np.ndarray, ctx: np.ndarray, qlen: np.ndarray,
                 feed: torch.Tensor | None = None) -> torch.Tensor:
        """Greedy next token (on the device) of each row after feeding positions ``[ctx, ctx + qlen)`` of its
        token row; ``feed`` (one-token rows only): the rows' input tokens, on the device (the host's token
        rows are not read for them)."""
        batch = build_batch(runner.token_ids, runner.block_table, slots, ctx, qlen, ctx + qlen, runner.block_size)
        n = len(qlen)
        fill = None if feed is None else (lambda ids: ids[:n].copy_(feed))
        logits = None
        if self.graphs is not None and batch.pure_decode:
            logits = self.graphs.run(batch, fill)
        elif self.catchup_graphs is not None and feed is None and len(batch.input_ids) == 2 * n and (qlen == 2).all():
            logits = self.catchup_graphs.run(batch)
            logits = None if logits is None else logits[1::2]  # each request's last token
        if logits is not None:
            self.num_graph_steps += 1
        else:
            inp = runner.device_inputs(batch)
            if fill is not None:
                fill(inp.input_ids)
            logits = self.model.forward(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata,
                                        inp.logits_indices, slot_mapping=inp.slot_mapping)
        return logits.argmax(-1)

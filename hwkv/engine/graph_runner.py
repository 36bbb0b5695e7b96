"""Decode fast path: device graphs per batch-size (and, for small batches, seq-len) bucket.

A pure-decode step (every request schedules one token and samples it) is padded up to the next
captured bucket and runs by ``graph.replay()``: a decoder of L layers launches ~12·L kernels per
step, which at batch 1 cost more CPU time than the device needs for them. Prefill and mixed steps
stay eager (their token counts vary too much to capture). Capture and replay go through the
backend's Device (``capture_graph``: CUDA graphs on hwkv-cuda, ACL graphs on hwkv-ascend); the
engine turns this path on where the backend declares ``Capabilities.graph_capture``.

Static buffers hold every input the graph reads, so a replay only refreshes their contents:
``input_ids``/``positions``/``slot_mapping`` (int64 ``[3, max_bs]``) and ``seq_lens`` + ``block_tables``
(int32) share one staging buffer on each side, so a small step's inputs go over in one host→device copy
(``IDS_WHOLE_BYTES``). ``query_start_loc`` is ``arange``, written once; a graph that wants every row's logits
passes no ``logits_indices`` (the model's "all rows"), one gather fewer before the LM head. Padded rows
write nothing (slot ``-1``) and read valid memory (``seq_len`` 1 over block 0).

Host-side launch parameters: a backend may size its grids from the metadata's host values (hwkv-cuda
picks the number of KV splits from ``max_seq_len``). A graph freezes them, so capture builds the
metadata with ``max_seq_len`` at the graph's seq-len bound (and host ``seq_lens`` at that bound):
the split count is then an upper bound, and splits past a request's real length exit at once and
carry weight 0 in the reduction (see docs/gpu-e2e.md). Batches of up to ``SMALL_BATCH`` requests
(where splitting KV matters) get one graph per seq-len bucket (512, 1024, …, ``max_model_len``)
and replay the smallest bound that covers the step; larger batches one graph at ``max_model_len``.
Inputs are staged in the device's host buffers (pinned where copies are asynchronous) and copied
without blocking; an event guards the staging buffers against reuse before their copy ran.

Host arguments that must change per step: where an op takes lengths as host values even in a graph
(hwkv-ascend: FIA / ATB paged attention read host length lists), the metadata builder may define
``before_replay(captured_metadata, step_metadata)``; it is called before every replay with the
metadata the graph was captured with and the core metadata of this step (true host lengths, padded
rows at 1), to re-bind those arguments in the captured graph (vllm-ascend's graph task update).

Verify steps (speculative decoding): a runner built with ``query_len=q > 1`` serves steps where every
request runs exactly ``q`` query tokens on its cached prefix (``k = q - 1`` drafts plus its last token)
and every query token's logits are wanted: ``query_start_loc`` is ``q·arange`` and ``logits_indices``
``arange(b·q)``, both written once. To the attention backend these are short prefill chunks of one
fixed shape per bucket, so host-side plans (hwkv-cuda: tokens, query lengths, q blocks) are exact and
the seq-len bound plays the decode graphs' role. Padded rows: ``q`` tokens at slot ``-1`` with
``seq_len`` ``q`` over block 0.

Short-query steps (a prompt's tail after a prefix-cache hit, alone or beside decodes): a runner built
with ``last_only=True`` serves steps where every request runs ``1..q`` query tokens (``q``: one KV
block, capped). :meth:`GraphRunner.run` pads each row to exactly ``q`` tokens (:func:`pad_queries`: the
verify graphs' shape, so backends that capture verify graphs capture these) and the graph computes the
logits of each row's last real token only: ``logits_indices`` is a static buffer refreshed per replay
(``[n, vocab]`` out, not ``[n·q, vocab]``). An eager forward of a 16-layer model costs milliseconds of
host time even for a few tokens; the replay costs a few copies.

Greedy tokens inside the graph (decode graphs of up to ``SAMPLE_MAX_BATCH`` requests, where the runner
passes ``sample``): the graph also runs the plain greedy sampler (``sample(logits)``: the runner's
argmax, the same functions as its eager sampler) into a static token buffer and copies those tokens into
an ``input_ids`` row (its own, or the other set's: below). The runner takes them as the step's tokens
when every request held is plain greedy (no penalties, logprobs, bitmask), and the next step, when its
rows are the same requests in the
same order (steady decoding), passes ``ids_ready=True``: the host→device copy then leaves the ids row
out and no device-side fill runs, so a step is one copy, one replay and the tokens' read-back.

Two sets (the runner's ``pingpong``): a second runner over its own static buffers, with graphs of the same
small buckets, takes every other steady step. Each set's sampling graphs feed the *other* set's ids row
(:meth:`GraphRunner.feed`), so a steady step's inputs (positions, slots, lengths, block tables: the ids
are already there) go over on a side stream into buffers that no queued replay reads - the previous
step's replay reads the other set's - and the replay waits for that copy only: the copy overlaps the
previous step on the device instead of standing between two replays. The tokens' read-back goes on a
second side stream after the replay; the next replay of the same graph (which rewrites them) comes at
the earliest two steps later, after the host has read them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hwkv.engine.inputs import StepBatch, metadata
from hwkv.interfaces.attention import GroupedMetadata
from hwkv.interfaces.device import Device, Graph


def batch_buckets(max_batch: int) -> list[int]:
    """Capture sizes: 1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


# Block-table entries past a step's widest request that a full-row copy would move before the step packs its
# tables instead (three copies instead of one): the full rows of 256 requests at max_model_len 131,072 are 8 MB
# a step over PCIe, for a few hundred KB the step reads
COMPACT_MIN = 1 << 16
# the step's ids / positions / slots (int64 rows of max_batch * query_len) go over whole while they are at most this
# many bytes: the rows' first b * q columns are not contiguous, and torch copies such a slice through a host-side
# contiguous temporary and a device-side scatter kernel (two more operations in every decode step's stream); with
# unpacked block tables they go in one DMA with seq_lens and the tables (one staging buffer)
IDS_WHOLE_BYTES = 1 << 16
SMALL_BATCH = 8  # batch buckets up to this many requests are also captured per seq-len bucket
# decode graphs of up to this many requests run the greedy sampler too (module doc): at small batches the two
# launches it saves are a visible share of the step, while at large ones a sampling (non-greedy) step would pay
# for an unused argmax over every row's logits
SAMPLE_MAX_BATCH = 8


def seq_buckets(max_model_len: int, first: int = 512) -> list[int]:
    """Seq-len bounds the small-batch graphs are captured at: ``first`` doubling, then ``max_model_len``."""
    out, s = [], first
    while s < max_model_len:
        out.append(s)
        s *= 2
    return out + [max_model_len]


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """Smallest bucket ``>= n`` (``None``: larger than every bucket, run eagerly)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def pad_into(batch: StepBatch, bucket: int, i64: np.ndarray, seq: np.ndarray, bt: np.ndarray, q: int = 1) -> None:
    """Write ``batch`` (``q`` query tokens per request: 1 for a pure decode) padded to ``bucket`` rows into
    staging views: ``i64 [3, >=bucket·q]`` (ids, positions, slots), ``seq [>=bucket]``, ``bt [>=bucket,
    max_blocks]``. Padded rows: tokens 0 at position 0, slot -1 (no KV write), seq_len ``q`` over block 0
    (a valid read)."""
    n, w = batch.block_tables.shape
    if n > bucket:
        raise ValueError(f"batch of {n} requests does not fit bucket {bucket}")
    if w > bt.shape[1]:
        raise ValueError(f"block table width {w} exceeds the static buffer's {bt.shape[1]}")
    if len(batch.input_ids) != n * q:
        raise ValueError(f"{len(batch.input_ids)} tokens for {n} requests: expected {q} per request")
    t, tb = n * q, bucket * q
    i64[0, :t], i64[1, :t], i64[2, :t] = batch.input_ids, batch.positions, batch.slot_mapping
    i64[0:2, t:tb] = 0
    i64[2, t:tb] = -1
    seq[:n] = batch.seq_lens
    seq[n:bucket] = q
    bt[:n, :w] = batch.block_tables
    bt[n:bucket, 0] = 0


def pad_groups(batch: StepBatch, bucket: int, g64: np.ndarray, g32: np.ndarray, q: int = 1) -> None:
    """:func:`pad_into` of KV-cache groups 1..'s slot mappings (``g64 [G-1, >=bucket·q]``) and block tables
    (``g32 [G-1, >=bucket, max_blocks]``), padded rows as there."""
    n, w = batch.block_tables.shape
    t, tb = n * q, bucket * q
    for g, (bt, sm) in enumerate(batch.groups):
        g64[g, :t], g64[g, t:tb] = sm, -1
        g32[g, :n, :w] = bt
        g32[g, n:bucket, 0] = 0


def pad_queries(batch: StepBatch, q: int, block_size: int) -> StepBatch:
    """``batch`` of decode rows with ``1..q`` query tokens each, as a batch of exactly ``q`` per row (the
    verify graphs' shape): each row's tokens first, then ``q - len`` padding tokens (id 0 at position 0,
    slot -1: no KV write); its ``seq_len`` grows by the padding, so its real tokens keep
    their positions and attend to exactly what they did (causal: padding comes after them), and its
    block-table row is widened with block 0 (valid reads for the padding's attention, whose output is
    discarded). ``logits_indices``/``sample_idx`` are left as given (the caller picks rows)."""
    qsl = batch.query_start_loc.astype(np.int64)
    ql = np.diff(qsl)
    n = len(ql)
    if ql.min(initial=1) < 1 or ql.max(initial=1) > q:
        raise ValueError(f"query lengths {ql.tolist()} are not all in [1, {q}]")
    dst = np.repeat(np.arange(n) * q, ql) + (np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], ql))
    ids, pos = np.zeros(n * q, np.int64), np.zeros(n * q, np.int64)
    ids[dst], pos[dst] = batch.input_ids, batch.positions
    seq = batch.seq_lens.astype(np.int64) + q - ql
    width = -(-int(seq.max()) // block_size)

    def widen(table: np.ndarray, sm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        bt, s = np.zeros((n, width), np.int32), np.full(n * q, -1, np.int64)
        bt[:, : table.shape[1]], s[dst] = table, sm
        return bt, s

    bt, slots = widen(batch.block_tables, batch.slot_mapping)
    return batch._replace(input_ids=ids, positions=pos, slot_mapping=slots,
                          query_start_loc=np.arange(0, (n + 1) * q, q, dtype=np.int32),
                          seq_lens=seq.astype(np.int32), block_tables=bt, num_decodes=n if q == 1 else 0,
                          max_query_len=q, groups=tuple(widen(t, sm) for t, sm in batch.groups))


def multi_token_graphs(meta_builder: Any) -> bool:
    """Whether graphs of multi-token queries (``query_len > 1``) may be captured with ``meta_builder``:
    its ``supports_verify_graphs`` where declared; else only builders without ``before_replay`` (one that
    re-binds host arguments per replay is taken to handle one-token queries only, as hwkv-ascend's)."""
    return bool(getattr(meta_builder, "supports_verify_graphs", not hasattr(meta_builder, "before_replay")))


class GraphRunner:
    """Static decode buffers + one captured graph per bucket.

    ``use_graphs=False`` runs the same static-buffer path eagerly (no capture): the padding and
    buffer logic is then testable on any device, with metadata built from the true host lengths.
    ``query_len``: query tokens per request (1: decode; ``k + 1``: verify steps, module doc).
    ``last_only``: rows of ``1..query_len`` tokens, logits of each row's last one (short-query steps).
    """

    def __init__(self, model: Any, kv_cache: Any, meta_builder: Any, device: Device, block_size: int,
                 max_batch: int, max_model_len: int, use_graphs: bool = True, query_len: int = 1,
                 last_only: bool = False, per_layer_hooks: bool = False,
                 sample: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if not isinstance(query_len, int) or not 1 <= query_len <= max_model_len:
            raise ValueError(f"query_len must be an int in [1, max_model_len={max_model_len}], got {query_len!r}")
        self.model, self.kv_cache, self.meta_builder = model, kv_cache, meta_builder
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        self.use_graphs, self.q, self.last_only = use_graphs, query_len, last_only
        # the greedy sampler captured in decode graphs of up to SAMPLE_MAX_BATCH rows (module doc)
        self.sample = sample if query_len == 1 and not last_only else None
        self.tokens: torch.Tensor | None = None  # the last run's in-graph tokens [n] (None: it sampled none)
        self.num_ids_ready = 0  # runs whose ids were already in the ids row (stats / tests)
        self.num_side_copies = 0  # runs whose inputs went over on a side stream (stats / tests)
        # A KV connector's per-layer load waits cost a graph node each (~6 us per replay on an H100):
        # where the connector allows it, graphs leave them out and wait for all loads before replay,
        # unless captured for the steps that load layer by layer (``per_layer_hooks``).
        hooks = getattr(model, "layer_hooks", None)
        self.hooks_left_out = hooks if hooks is not None and not per_layer_hooks and getattr(
            hooks, "layer_hooks_only_when_loading", False) else None
        self.buckets = batch_buckets(max_batch)
        self.seq_buckets = seq_buckets(max_model_len)
        mb, self.max_blocks = max_batch, -(-max_model_len // block_size)
        self.max_batch = max_batch
        td, q = device.torch_device, query_len
        rows = 4 if last_only else 3  # last_only: row 3 holds each request's logits index
        # one staging buffer [int64 rows | int32 seq_lens + block tables] on each side, so that a small step's
        # inputs go over as ONE contiguous DMA (IDS_WHOLE_BYTES)
        self._n64 = 2 * rows * mb * q  # the int64 rows in int32 words
        self.hbuf = device.host_zeros(self._n64 + mb + mb * self.max_blocks, torch.int32)
        self.dbuf = torch.zeros(self._n64 + mb + mb * self.max_blocks, dtype=torch.int32, device=td)
        self.h64 = self.hbuf[: self._n64].view(torch.int64).view(rows, mb * q)
        self.h32 = self.hbuf[self._n64:]
        self.d64 = self.dbuf[: self._n64].view(torch.int64).view(rows, mb * q)
        self.d32 = self.dbuf[self._n64:]
        self.seq_lens = self.d32[:mb]
        self.block_tables = self.d32[mb:].view(mb, self.max_blocks)
        # a step's block tables packed [b, width] (COMPACT_MIN): staged, copied, spread into block_tables' rows
        self.hbt = device.host_zeros(mb * self.max_blocks, torch.int32)
        self.dbt = torch.zeros(mb * self.max_blocks, dtype=torch.int32, device=td)
        self.query_start_loc = torch.arange(0, (mb + 1) * q, q, dtype=torch.int32, device=td)
        self.logits_indices = torch.arange(mb * q, dtype=torch.int64, device=td)
        # KV-cache groups 1.. (hwkv.engine.kv_groups.GroupedKVCache): their slot mappings and block tables
        self.layer_group = getattr(kv_cache, "layer_group", None)
        ng = len(getattr(kv_cache, "groups", ())[1:])
        self.g64, self.g32 = device.host_zeros((ng, mb * q), torch.int64), device.host_zeros(
            (ng, mb, self.max_blocks), torch.int32)
        self.dg64 = torch.zeros((ng, mb * q), dtype=torch.int64, device=td)
        self.dg32 = torch.zeros((ng, mb, self.max_blocks), dtype=torch.int32, device=td)
        self._copied = device.new_event()
        # the runner whose ids row the sampling graphs feed (``feed``: a second set of buffers and graphs)
        self.feeds: GraphRunner = self
        self.next_ids = self.d64[0]
        # (batch, seq-len bound) -> (graph, logits, metadata): the metadata must outlive the graph,
        # since it owns tensors the backend built outside the capture (hwkv-cuda's cached plan)
        self.graphs: dict[tuple[int, int], tuple[Graph, torch.Tensor, Any]] = {}
        # (batch, seq-len bound) -> (graph, its in-graph greedy tokens) where it samples (module doc)
        self.graph_tokens: dict[tuple[int, int], tuple[Graph, torch.Tensor]] = {}
        self.pool: Any = None
        self._before_replay = getattr(meta_builder, "before_replay", None)  # optional hook (module doc)

    def _common(self, b: int, seq_cpu: torch.Tensor) -> Any:
        q = self.q
        return metadata(self.query_start_loc[: b + 1], self.seq_lens[:b], self.block_tables[:b], self.d64[2, : b * q],
                        torch.arange(0, (b + 1) * q, q, dtype=torch.int32), seq_cpu, self.block_size,
                        num_decodes=b if q == 1 else 0, max_query_len=q)

    def _metadata(self, b: int, seq_cpu: torch.Tensor) -> Any:
        md = self.meta_builder.build(self._common(b, seq_cpu))
        if not len(self.dg64):
            return md
        q = self.q
        qsl_cpu = torch.arange(0, (b + 1) * q, q, dtype=torch.int32)
        per = [(md, self.d64[2, : b * q])] + [
            (self.meta_builder.build(metadata(self.query_start_loc[: b + 1], self.seq_lens[:b], bt[:b], sm[: b * q],
                                              qsl_cpu, seq_cpu, self.block_size, num_decodes=b if q == 1 else 0,
                                              max_query_len=q)), sm[: b * q])
            for bt, sm in zip(self.dg32, self.dg64)]
        return GroupedMetadata(per, self.layer_group)  # type: ignore[arg-type]

    def _forward(self, b: int, md: Any) -> torch.Tensor:
        t = b * self.q
        # every row's logits in order unless last_only: None rather than the gather of arange(t) - one kernel fewer
        # before the LM head, which then follows the last layer's projection directly (PDL on CUDA)
        idx = self.d64[3, :b] if self.last_only else None
        return self.model.forward(self.d64[0, :t], self.d64[1, :t], self.kv_cache, md, idx,
                                  slot_mapping=self.d64[2, :t])

    def feed(self, other: GraphRunner) -> None:
        """Sampling graphs (captured after this call) write their tokens into ``other``'s ids row (module doc)."""
        self.feeds, self.next_ids = other, other.d64[0]

    def samples(self, b: int) -> bool:
        """Whether the graphs of batch bucket ``b`` run the greedy sampler (module doc)."""
        return self.sample is not None and b <= SAMPLE_MAX_BATCH

    def _forward_sample(self, b: int, md: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured step: logits, and where ``samples(b)`` the greedy tokens of every row, also written
        into the input ids (the next steady step's inputs)."""
        logits = self._forward(b, md)
        if not self.samples(b):
            return logits, None
        tokens = self.sample(logits)  # type: ignore[misc]
        self.next_ids[:b].copy_(tokens)
        return logits, tokens

    def keys(self) -> list[tuple[int, int]]:
        """(batch bucket, seq-len bound) of every graph: small batches at each seq-len bucket (their
        attention grid may be sized by the bound: short contexts must not pay for the longest),
        larger ones at ``max_model_len`` only."""
        return [(b, s) for b in self.buckets
                for s in (self.seq_buckets if b <= SMALL_BATCH else [self.max_model_len])]

    def key(self, n: int, max_seq_len: int) -> tuple[int, int] | None:
        b = pick_bucket(self.buckets, n)
        if b is None:
            return None
        s = pick_bucket(self.seq_buckets, max_seq_len) if b <= SMALL_BATCH else self.max_model_len
        return None if s is None else (b, s)

    def graph(self, n: int, max_seq_len: int) -> Graph | None:
        """The captured graph serving ``n`` requests up to ``max_seq_len`` (for benchmarks), if any."""
        key = self.key(n, max_seq_len)
        entry = self.graphs.get(key) if key is not None else None
        return None if entry is None else entry[0]

    @torch.inference_mode()
    def capture(self, pool: Any = None, batches: Any = None) -> None:
        """Capture every key, largest first (smaller graphs reuse its memory pool); ``pool``: another
        runner's pool to share (graphs of one engine replay one at a time). ``batches``: only the keys of
        these batch buckets, again (benchmarks' A/B of what a graph holds, e.g. ``sample``)."""
        if not self.use_graphs:
            return
        dev = self.device
        self.d64[2].fill_(-1)  # capture-time passes write no KV
        self.dg64.fill_(-1)
        self.dg32.zero_()
        if self.last_only:
            self.d64[3, : self.max_batch].copy_(self.logits_indices[:: self.q])
        self.seq_lens.fill_(self.q)
        self.block_tables.zero_()
        self.pool = dev.graph_pool() if pool is None else pool
        stream = dev.new_stream()
        stream.wait_stream(dev.current_stream())
        if self.hooks_left_out is not None:
            self.model.set_layer_hooks(None)
        try:
            with dev.stream_context(stream):
                for b, s in sorted(self.keys(), reverse=True):  # s >= q: the bound covers the query
                    if batches is not None and b not in batches:
                        continue
                    md = self._metadata(b, torch.full((b,), s, dtype=torch.int32))
                    self._forward_sample(b, md)  # warm-up: kernels compile, the allocator settles
                    g, (out, tok) = dev.capture_graph(lambda b=b, md=md: self._forward_sample(b, md), self.pool,
                                                      stream)
                    self.graphs[(b, s)] = (g, out, md)
                    self.graph_tokens.pop((b, s), None)
                    if tok is not None:
                        self.graph_tokens[(b, s)] = (g, tok)
        finally:
            if self.hooks_left_out is not None:
                self.model.set_layer_hooks(self.hooks_left_out)
        dev.current_stream().wait_stream(stream)
        dev.synchronize()

    def run(self, batch: StepBatch, fill: Callable[[torch.Tensor], None] | None = None,
            ids_ready: bool = False, copy_stream: Any = None) -> torch.Tensor | None:
        """float32 logits ``[n·q, vocab]`` of one step of ``n`` requests with ``q`` query tokens each (a
        pure decode: ``[n, vocab]``; a verify step: every query token's, request-major; ``last_only``:
        ``[n, vocab]`` of rows with ``1..q`` tokens, each row's last token's), or ``None`` when
        ``n`` exceeds every bucket or the block table is wider than the static one (the caller runs
        eagerly). ``fill(input_ids)`` runs after the inputs are copied in and before the forward: it
        patches ids that are still on the device (async stepping). ``ids_ready``: every row's input id is
        already in the ids row - the previous step was a sampling replay of these graphs over the same rows
        in the same order (module doc) - so neither the ids row nor ``fill`` goes over. ``self.tokens``: the
        step's in-graph greedy tokens (int64 ``[n]``, valid until the next replay), or ``None``.
        ``copy_stream``: copy the inputs in on that stream and let the replay wait for the copies only (the
        caller knows that no queued work reads or writes these buffers: module doc)."""
        self.tokens = None
        n, q = batch.seq_lens.shape[0], self.q
        if self.last_only:
            last = batch.query_start_loc[1:].astype(np.int64) - batch.query_start_loc[:-1] - 1
            batch = pad_queries(batch, q, self.block_size)
        max_seq = int(batch.seq_lens.max())
        key = self.key(n, max_seq)
        if key is None or batch.block_tables.shape[1] > self.max_blocks or max_seq > self.max_model_len:
            return None
        b = key[0]
        self._copied.synchronize()  # the previous step's copies have read the staging buffers
        mb = self.max_batch
        h32 = self.h32.numpy()
        w = batch.block_tables.shape[1]
        packed = b * (self.max_blocks - w) > COMPACT_MIN
        bt = self.hbt.numpy()[: b * w].reshape(b, w) if packed else h32[mb:].reshape(mb, self.max_blocks)
        h64 = self.h64.numpy()
        pad_into(batch, b, h64, h32[:mb], bt, q)
        if batch.groups:
            pad_groups(batch, b, self.g64.numpy(), self.g32.numpy(), q)
        if self.last_only:  # each row's last real token; padded rows their first (any valid row)
            h64[3, :b] = np.arange(0, b * q, q)
            h64[3, :n] += last
        r0 = 1 if ids_ready else 0  # the first int64 row that goes over
        self.num_ids_ready += r0
        dev = self.device
        if copy_stream is not None:
            self.num_side_copies += 1
            with dev.stream_context(copy_stream):
                self._copy_in(b, w, packed, r0)
            dev.current_stream().wait_event(self._copied)
        else:
            self._copy_in(b, w, packed, r0)
        if fill is not None and not ids_ready:
            fill(self.d64[0, : b * q])
        if self.use_graphs:
            g, out, md = self.graphs[key]
            gt = self.graph_tokens.get(key)
            tok = gt[1] if gt is not None and gt[0] is g else None
            if self._before_replay is not None:  # each KV-cache group's captured launches (same lengths)
                common = self._common(b, torch.from_numpy(h32[:b].copy()))
                for gmd, _ in md.per_group if type(md) is GroupedMetadata else ((md, None),):
                    self._before_replay(gmd, common)
            if self.hooks_left_out is not None:
                self.hooks_left_out.wait_for_all_layer_loads()
            g.replay()
            self.tokens = None if tok is None else tok[:n]
            return out[: n if self.last_only else n * q]
        seq_cpu = torch.from_numpy(h32[:b].copy())
        out, tok = self._forward_sample(b, self._metadata(b, seq_cpu))
        self.tokens = None if tok is None else tok[:n]
        return out[: n if self.last_only else n * q]

    def _copy_in(self, b: int, w: int, packed: bool, r0: int) -> None:
        """The staged inputs of a step of bucket ``b`` (block tables ``w`` wide) to the device, int64 rows from
        ``r0`` on; the event ``_copied`` recorded after them (on the current stream)."""
        q, mb = self.q, self.max_batch
        if self.dg64.shape[0]:  # KV-cache groups 1..: their slot mappings and tables (pad_groups)
            self.dg64[:, : b * q].copy_(self.g64[:, : b * q], non_blocking=True)
            self.dg32[:, :b].copy_(self.g32[:, :b], non_blocking=True)
        whole = self.h64.numel() * self.h64.element_size() <= IDS_WHOLE_BYTES
        if whole and not packed:
            # ids rows whole, seq_lens, the first b - 1 block-table rows whole and the last one's first w columns
            # (the kernels read no column past the step's widest table): one contiguous DMA
            start, end = r0 * 2 * mb * q, self._n64 + mb + (b - 1) * self.max_blocks + max(w, 1)
            self.dbuf[start:end].copy_(self.hbuf[start:end], non_blocking=True)
        else:
            if whole:
                self.d64[r0:].copy_(self.h64[r0:], non_blocking=True)
            else:
                self.d64[r0:, : b * q].copy_(self.h64[r0:, : b * q], non_blocking=True)
            if packed:  # only the columns this step's requests use: the rest is never read
                self.d32[:mb].copy_(self.h32[:mb], non_blocking=True)
                self.dbt[: b * w].copy_(self.hbt[: b * w], non_blocking=True)
                self.block_tables[:b, :w].copy_(self.dbt[: b * w].view(b, w))
            else:  # seq_lens and the first b block-table rows are contiguous: one copy
                end = mb + b * self.max_blocks
                self.d32[:end].copy_(self.h32[:end], non_blocking=True)
        self._copied.record()

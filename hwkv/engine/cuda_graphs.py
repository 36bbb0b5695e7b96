"""Decode fast path: CUDA graphs per batch-size (and, for small batches, seq-len) bucket.

A pure-decode step (every request schedules one token and samples it) is padded up to the next
captured bucket and runs by ``graph.replay()``: a decoder of L layers launches ~12·L kernels per
step, which at batch 1 cost more CPU time than the GPU needs for them. Prefill and mixed steps stay
eager (their token counts vary too much to capture).

Static buffers hold every input the graph reads, so a replay only refreshes their contents:
``input_ids``/``positions``/``slot_mapping`` (int64 ``[3, max_bs]``, one host→device copy) and
``seq_lens`` + ``block_tables`` (one int32 buffer, one copy). ``query_start_loc`` is ``arange``
and ``logits_indices`` is ``arange`` for every decode batch, so they are written once. Padded rows
write nothing (slot ``-1``) and read valid memory (``seq_len`` 1 over block 0).

Host-side launch parameters: a backend may size its grids from the metadata's host values (hwkv-cuda
picks the number of KV splits from ``max_seq_len``). A graph freezes them, so capture builds the
metadata with ``max_seq_len`` at the graph's seq-len bound (and host ``seq_lens`` at that bound):
the split count is then an upper bound, and splits past a request's real length exit at once and
carry weight 0 in the reduction (see docs/gpu-e2e.md). Batches of up to ``SMALL_BATCH`` requests
(where splitting KV matters) get one graph per seq-len bucket (512, 1024, …, ``max_model_len``)
and replay the smallest bound that covers the step; larger batches one graph at ``max_model_len``.
Inputs are staged in pinned host memory and copied with ``non_blocking=True``; an event guards the
staging buffers against reuse before their copy ran.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from hwkv.interfaces.attention import AttentionMetadata


def batch_buckets(max_batch: int) -> list[int]:
    """Capture sizes: 1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


SMALL_BATCH = 8  # batch buckets up to this many requests are also captured per seq-len bucket


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


class DecodeBatch(NamedTuple):
    """Host inputs of one pure-decode step of ``n`` requests (numpy, unpadded)."""

    input_ids: np.ndarray  # [n] int64
    positions: np.ndarray  # [n] int64
    slot_mapping: np.ndarray  # [n] int64
    seq_lens: np.ndarray  # [n] int32
    block_tables: np.ndarray  # [n, w] int32, w >= every row's block count


def pad_into(batch: DecodeBatch, bucket: int, i64: np.ndarray, seq: np.ndarray, bt: np.ndarray) -> None:
    """Write ``batch`` padded to ``bucket`` rows into staging views: ``i64 [3, >=bucket]`` (ids,
    positions, slots), ``seq [>=bucket]``, ``bt [>=bucket, max_blocks]``. Padded rows: token 0 at
    position 0, slot -1 (no KV write), seq_len 1 over block 0 (a valid read)."""
    n, w = batch.block_tables.shape
    if n > bucket:
        raise ValueError(f"batch of {n} requests does not fit bucket {bucket}")
    if w > bt.shape[1]:
        raise ValueError(f"block table width {w} exceeds the static buffer's {bt.shape[1]}")
    i64[0, :n], i64[1, :n], i64[2, :n] = batch.input_ids, batch.positions, batch.slot_mapping
    i64[0:2, n:bucket] = 0
    i64[2, n:bucket] = -1
    seq[:n] = batch.seq_lens
    seq[n:bucket] = 1
    bt[:n, :w] = batch.block_tables
    bt[n:bucket, 0] = 0


class GraphRunner:
    """Static decode buffers + one captured graph per bucket.

    ``use_graphs=False`` runs the same static-buffer path eagerly (no capture): the padding and
    buffer logic is then testable on any device, with metadata built from the true host lengths.
    """

    def __init__(self, model: Any, kv_cache: Any, meta_builder: Any, block_size: int, max_batch: int,
                 max_model_len: int, device: torch.device, use_graphs: bool = True):
        self.model, self.kv_cache, self.meta_builder = model, kv_cache, meta_builder
        self.block_size, self.max_model_len, self.device = block_size, max_model_len, device
        self.use_graphs = use_graphs
        self.buckets = batch_buckets(max_batch)
        self.seq_buckets = seq_buckets(max_model_len)
        mb, self.max_blocks = max_batch, -(-max_model_len // block_size)
        pin = device.type == "cuda"
        self.h64 = torch.zeros((3, mb), dtype=torch.int64, pin_memory=pin)
        self.h32 = torch.zeros(mb + mb * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.d64 = torch.zeros((3, mb), dtype=torch.int64, device=device)
        self.d32 = torch.zeros(mb + mb * self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = self.d32[:mb]
        self.block_tables = self.d32[mb:].view(mb, self.max_blocks)
        self.query_start_loc = torch.arange(mb + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(mb, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event() if pin else None
        # (batch, seq-len bound) -> (graph, logits, metadata): the metadata must outlive the graph,
        # since it owns tensors the backend built outside the capture (hwkv-cuda's cached plan)
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor, Any]] = {}
        self.pool: Any = None

    def _metadata(self, b: int, seq_cpu: torch.Tensor) -> Any:
        qsl_cpu = torch.arange(b + 1, dtype=torch.int32)
        common = AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], slot_mapping=self.d64[2, :b], query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu, block_size=self.block_size, num_prefills=0, num_decodes=b,
            num_prefill_tokens=0, num_decode_tokens=b, max_query_len=1, max_seq_len=int(seq_cpu.max()),
        )
        return self.meta_builder.build(common)

    def _forward(self, b: int, md: Any) -> torch.Tensor:
        return self.model.forward(self.d64[0, :b], self.d64[1, :b], self.kv_cache, md, self.logits_indices[:b],
                                  slot_mapping=self.d64[2, :b])

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

    def graph(self, n: int, max_seq_len: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph serving ``n`` requests up to ``max_seq_len`` (for benchmarks), if any."""
        key = self.key(n, max_seq_len)
        entry = self.graphs.get(key) if key is not None else None
        return None if entry is None else entry[0]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every key, largest first (smaller graphs reuse its memory pool)."""
        if not self.use_graphs:
            return
        self.d64[2].fill_(-1)  # capture-time passes write no KV
        self.seq_lens.fill_(1)
        self.block_tables.zero_()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for b, s in sorted(self.keys(), reverse=True):
                md = self._metadata(b, torch.full((b,), s, dtype=torch.int32))
                self._forward(b, md)  # warm-up: Triton compiles, allocator settles
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool, stream=stream):
                    out = self._forward(b, md)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[(b, s)] = (g, out, md)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def run(self, batch: DecodeBatch, fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """float32 logits ``[n, vocab]`` of one pure-decode step, or ``None`` when ``n`` exceeds
        every bucket or the block table is wider than the static one (the caller runs eagerly).
        ``fill(input_ids)`` runs after the inputs are copied in and before the forward: it patches
        ids that are still on the device (async stepping)."""
        n = batch.input_ids.shape[0]
        key = self.key(n, int(batch.seq_lens.max()))
        if key is None or batch.block_tables.shape[1] > self.max_blocks:
            return None
        b = key[0]
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the staging buffers
        mb = self.h64.shape[1]
        h32 = self.h32.numpy()
        bt = h32[mb:].reshape(mb, self.max_blocks)
        pad_into(batch, b, self.h64.numpy(), h32[:mb], bt)
        async_copy = self._copied is not None
        self.d64[:, :b].copy_(self.h64[:, :b], non_blocking=async_copy)
        # seq_lens and the first b block-table rows are contiguous: one copy
        end = mb + b * self.max_blocks
        self.d32[:end].copy_(self.h32[:end], non_blocking=async_copy)
        if self._copied is not None:
            self._copied.record()
        if fill is not None:
            fill(self.d64[0, :b])
        if self.use_graphs:
            g, out, _ = self.graphs[key]
            g.replay()
            return out[:n]
        seq_cpu = torch.from_numpy(h32[:b].copy())
        return self._forward(b, self._metadata(b, seq_cpu))[:n]


def fuse_elementwise(model: Any, backend: str = "inductor") -> int:
    """Replace the model's RMSNorm (with its residual add), RoPE and SiLU·mul forwards by
    ``torch.compile``d functions (one fused kernel each instead of 2–12 small ones; a decode step
    of a small model is dominated by those launches). Same math; shapes are dynamic, so one
    compilation (plus one for a single token) serves every batch. Dynamo keeps at most 8 variants
    per function per process: a process building engines of many dtypes runs the surplus variants
    uncompiled (correct, slower).
    Returns the number of modules patched."""
    from hwkv.model.llama import MLP, RMSNorm, add_rms_norm, rms_norm, silu_mul
    from hwkv.model.rope import RotaryEmbedding, apply_rope

    rms = torch.compile(rms_norm, dynamic=True, backend=backend)
    add_rms = torch.compile(add_rms_norm, dynamic=True, backend=backend)
    rope = torch.compile(apply_rope, dynamic=True, backend=backend)
    act = torch.compile(silu_mul, dynamic=True, backend=backend)
    n = 0
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = lambda x, residual=None, m=m: (rms(x, m.weight, m.eps) if residual is None
                                                        else add_rms(x, residual, m.weight, m.eps))
        elif isinstance(m, RotaryEmbedding):
            m.forward = lambda positions, q, k, m=m: rope(m.cos, m.sin, positions, q, k)
        elif isinstance(m, MLP):
            m.forward = lambda x, m=m: m.down_proj(act(m.gate_up_proj(x), m.inter))
        else:
            continue
        n += 1
    return n

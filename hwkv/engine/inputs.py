"""The step's inputs, built once: scheduled requests → host arrays → device tensors + metadata.

:func:`build_batch` computes every array a forward reads — input ids, positions, slot mapping,
query start locations, sequence lengths, block-table rows, logits indices — in one place, in bulk
(numpy: a few µs per op where a small torch op costs ~10 µs), from the runner's persistent
per-slot tables. Two routes take a :class:`StepBatch` to the device, and both build the attention
metadata through :func:`metadata`: :func:`to_device` (eager steps: two packed host→device copies)
and the graph runner (pure-decode steps: padded into static buffers,
:mod:`hwkv.engine.graph_runner`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from hwkv.interfaces.attention import AttentionMetadata, GroupedMetadata, slot_mapping
from hwkv.interfaces.device import Device


class StepBatch(NamedTuple):
    """Host (numpy) inputs of one step of ``R`` requests and ``T`` tokens."""

    input_ids: np.ndarray  # [T] int64 (rows whose last token is still on the device: a placeholder)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [R + 1] int32
    seq_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, w] int32, w = blocks of the longest sequence
    logits_indices: np.ndarray  # [S] int64: last scheduled token of each sampling request
    sample_idx: np.ndarray  # [S] batch rows that sample a token this step
    num_decodes: int  # requests scheduling one token
    max_query_len: int
    # KV-cache groups 1.. (hwkv.engine.kv_groups): each group's (block_tables, slot_mapping) as above
    groups: tuple[tuple[np.ndarray, np.ndarray], ...] = ()

    @property
    def pure_decode(self) -> bool:
        """Every request decodes one token and samples it (the shape graphs serve)."""
        n = len(self.seq_lens)
        return len(self.input_ids) == n and len(self.sample_idx) == n


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] long, on the device
    positions: torch.Tensor  # [T] long
    attn_metadata: Any  # what the backend's metadata builder returned
    logits_indices: torch.Tensor  # [S] long
    slot_mapping: torch.Tensor  # [T] long, passed explicitly: a backend's metadata need not carry it


def build_batch(token_ids: np.ndarray, block_table: np.ndarray, slots: np.ndarray, ctx: np.ndarray,
                query_lens: np.ndarray, num_tokens: np.ndarray, block_size: int) -> StepBatch:
    """One step's host inputs. Per request ``i``: its rows ``slots[i]`` of ``token_ids`` /
    ``block_table``, ``ctx[i]`` tokens already computed, ``query_lens[i]`` scheduled now, and
    ``num_tokens[i]`` tokens known (it samples when the step reaches that many)."""
    R = len(slots)
    seq = ctx + query_lens
    qsl = np.zeros(R + 1, dtype=np.int64)
    np.cumsum(query_lens, out=qsl[1:])
    T = int(qsl[-1])
    if T == R:  # decodes only
        req_idx, positions = np.arange(R), ctx
    else:
        req_idx = np.repeat(np.arange(R), query_lens)
        positions = np.arange(T) - qsl[:-1][req_idx] + ctx[req_idx]
    bt = block_table[slots, : -(-int(seq.max()) // block_size)]
    sample_idx = np.flatnonzero(seq == num_tokens)
    return StepBatch(
        input_ids=token_ids[slots[req_idx], positions].astype(np.int64),
        positions=positions.astype(np.int64, copy=False),
        slot_mapping=slot_mapping(bt, req_idx, positions, block_size).astype(np.int64, copy=False),
        query_start_loc=qsl.astype(np.int32), seq_lens=seq.astype(np.int32), block_tables=bt,
        logits_indices=qsl[1:][sample_idx] - 1, sample_idx=sample_idx,
        num_decodes=int((query_lens == 1).sum()), max_query_len=int(query_lens.max()),
    )


def group_inputs(batch: StepBatch, tables: list[np.ndarray], slots: np.ndarray,
                 block_size: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """``(block_tables, slot_mapping)`` of ``batch`` over each of ``tables`` (the runner's per-slot block
    tables of KV-cache groups 1..): the same rows and width as group 0's, padding tokens (slot -1 in
    group 0) at -1 too. A row's entries past its blocks are 0 in the runner's tables, as group 0's."""
    w = batch.block_tables.shape[1]
    req_idx = np.repeat(np.arange(len(slots)), np.diff(batch.query_start_loc))
    pad = batch.slot_mapping < 0
    out = []
    for bt in (t[slots, :w] for t in tables):
        sm = slot_mapping(bt, req_idx, batch.positions, block_size).astype(np.int64, copy=False)
        out.append((bt, np.where(pad, -1, sm) if pad.any() else sm))
    return tuple(out)


def metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
             slots: torch.Tensor, query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, block_size: int,
             num_decodes: int, max_query_len: int) -> AttentionMetadata:
    """Core metadata over device tensors (any route) and their host copies."""
    R, T = int(seq_lens_cpu.numel()), int(slots.numel())
    return AttentionMetadata(
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables, slot_mapping=slots,
        query_start_loc_cpu=query_start_loc_cpu, seq_lens_cpu=seq_lens_cpu, block_size=block_size,
        num_prefills=R - num_decodes, num_decodes=num_decodes, num_prefill_tokens=T - num_decodes,
        num_decode_tokens=num_decodes, max_query_len=max_query_len, max_seq_len=int(seq_lens_cpu.max()),
    )


def to_device(batch: StepBatch, device: Device, meta_builder: Any, block_size: int,
              layer_group: list[int] | None = None) -> StepInputs:
    """The eager route: two host→device copies (all int64 arrays, all int32 arrays), sliced on device.
    With KV-cache groups (``batch.groups``, ``layer_group[i]``: layer ``i``'s group) the metadata is a
    :class:`~hwkv.interfaces.attention.GroupedMetadata`."""
    b = batch
    i64 = _packed([b.input_ids, b.positions, b.slot_mapping, b.logits_indices, *(sm for _, sm in b.groups)],
                  np.int64, device)
    i32 = _packed([b.query_start_loc, b.seq_lens, b.block_tables, *(bt for bt, _ in b.groups)], np.int32, device)
    qsl_cpu, seq_cpu = torch.from_numpy(b.query_start_loc), torch.from_numpy(b.seq_lens)
    md = meta_builder.build(metadata(i32[0], i32[1], i32[2], i64[2], qsl_cpu, seq_cpu, block_size, b.num_decodes,
                                     b.max_query_len))
    if b.groups:
        per = [(md, i64[2])] + [(meta_builder.build(metadata(i32[0], i32[1], bt, sm, qsl_cpu, seq_cpu, block_size,
                                                             b.num_decodes, b.max_query_len)), sm)
                                for bt, sm in zip(i32[3:], i64[4:])]
        md = GroupedMetadata(per, layer_group)  # type: ignore[arg-type]
    return StepInputs(i64[0], i64[1], md, i64[3], i64[2])


def _packed(arrays: list[np.ndarray], dtype: type, device: Device) -> list[torch.Tensor]:
    """Tensors on ``device`` with the arrays' shapes, from one packed copy (zero-copy on the host)."""
    flat = device.to_device(torch.from_numpy(np.concatenate([a.ravel().astype(dtype, copy=False)
                                                             for a in arrays])))
    out, off = [], 0
    for a in arrays:
        out.append(flat[off : off + a.size].view(a.shape))
        off += a.size
    return out

"""The verify graphs' padded inputs, built straight from the runner's tables.

A pure-verify step (every request runs its last token plus ``k_i < q`` drafts on its cached prefix and
samples) replays a verify graph of ``q = k + 1`` query tokens per row. :func:`verify_batch` writes that
padded batch directly — ``[R, q]`` numpy grids, one pass — where the general route builds the
unpadded batch (:func:`~hwkv.engine.inputs.build_batch`) and then re-lays it
(:func:`~hwkv.engine.graph_runner.pad_queries`): the same arrays for about a third of the host time,
which on a GPU is serial with the verify forward (speculative steps run synchronously).
"""

from __future__ import annotations

import numpy as np

from hwkv.engine.inputs import StepBatch


def verify_batch(token_ids: np.ndarray, block_table: np.ndarray, slots: np.ndarray, ctx: np.ndarray,
                 ks: np.ndarray, q: int, block_size: int) -> StepBatch:
    """``pad_queries(build_batch(token_ids, block_table, slots, ctx, ks + 1, ctx + ks + 1, block_size), q,
    block_size)``, array for array: row ``i`` (token-table row ``slots[i]``, ``ctx[i]`` tokens computed)
    runs positions ``ctx[i] .. ctx[i] + ks[i]`` and then ``q - 1 - ks[i]`` padding tokens (id 0, position 0,
    slot -1); its ``seq_len`` is ``ctx[i] + q``; its block-table row holds the blocks its real tokens reach,
    then block 0. Requires ``0 <= ks < q``."""
    R, bs = len(slots), block_size
    ql = ks + 1
    real = np.arange(q) < ql[:, None]  # [R, q]
    pos = np.where(real, ctx[:, None] + np.arange(q), 0)
    w_real = -(-int((ctx + ql).max()) // bs)
    seq = ctx + q
    bt = np.zeros((R, -(-int(seq.max()) // bs)), np.int32)
    bt[:, :w_real] = block_table[slots, :w_real]
    blocks = bt[np.arange(R)[:, None], pos // bs].astype(np.int64)
    qsl_real = np.cumsum(ql)
    return StepBatch(
        input_ids=np.where(real, token_ids[slots[:, None], pos], 0).astype(np.int64).ravel(),
        positions=pos.astype(np.int64, copy=False).ravel(),
        slot_mapping=np.where(real, blocks * bs + pos % bs, -1).ravel(),
        query_start_loc=np.arange(0, (R + 1) * q, q, dtype=np.int32), seq_lens=seq.astype(np.int32),
        block_tables=bt, logits_indices=qsl_real - 1, sample_idx=np.arange(R),
        num_decodes=R if q == 1 else 0, max_query_len=q,
    )


def verify_batch_rows(token_ids: np.ndarray, block_table: np.ndarray, slots: list[int], ctx: list[int],
                      ks: list[int], q: int, block_size: int) -> StepBatch:
    """:func:`verify_batch` built row by row in plain Python (host lists in, a handful of array
    conversions out): for a few requests cheaper than its numpy grids, whose per-call overhead dominates
    there. Same arrays, same contract."""
    bs, R = block_size, len(slots)
    ids: list[int] = []
    pos: list[int] = []
    sm: list[int] = []
    top = 0
    for s, c, k in zip(slots, ctx, ks):
        n, pad = k + 1, q - k - 1
        ids += token_ids[s, c : c + n].tolist()
        ids += [0] * pad
        b0 = c // bs
        row = block_table[s, b0 : (c + k) // bs + 1].tolist()
        for p in range(c, c + n):
            pos.append(p)
            sm.append(row[p // bs - b0] * bs + p % bs)
        pos += [0] * pad
        sm += [-1] * pad
        top = max(top, c + n)
    w_real = -(-top // bs)
    bt = np.zeros((R, -(-(max(ctx) + q) // bs)), np.int32)
    bt[:, :w_real] = block_table[slots, :w_real]
    return StepBatch(
        input_ids=np.array(ids, dtype=np.int64), positions=np.array(pos, dtype=np.int64),
        slot_mapping=np.array(sm, dtype=np.int64), query_start_loc=np.arange(0, (R + 1) * q, q, dtype=np.int32),
        seq_lens=np.array(ctx, dtype=np.int32) + np.int32(q), block_tables=bt,
        logits_indices=np.cumsum(np.array(ks, dtype=np.int64) + 1) - 1, sample_idx=np.arange(R),
        num_decodes=R if q == 1 else 0, max_query_len=q,
    )

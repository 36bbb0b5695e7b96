"""Megatron-style tensor-parallel sharding of a decoder: which slice of each weight a rank holds.

Layout over ``N`` ranks (rank ``r``):

* attention: q heads ``[r*H/N, (r+1)*H/N)``; KV heads ``[r*KV/N, (r+1)*KV/N)`` when ``KV >= N``,
  else the single head ``r*KV//N`` (replicated: ``N/KV`` ranks hold each head, and a rank's q heads
  all belong to that head's GQA group). q/k/v are column-parallel (rows of the fused qkv), ``o_proj``
  row-parallel (its input columns), its output summed over the ranks by one all-reduce.
* MLP (and every MoE expert): gate/up column-parallel over the intermediate dim, ``down_proj``
  row-parallel, one all-reduce per layer after the MLP (after the expert sum for MoE). The router
  and all norms (Qwen3's per-head q/k norm included) are replicated.
* vocabulary: rank ``r`` holds rows ``[r*s, min((r+1)*s, V))`` of the embedding and LM head,
  ``s = ceil(V/N)`` (the last shard zero-padded to ``s`` rows). The embedding is a masked lookup +
  all-reduce; the LM head's logits are all-gathered and the padding cut off.
* row-parallel biases are added once: rank 0 loads them, the others hold zeros.

The loader reads only a rank's slices (``safe_open(...).get_slice``): no rank ever holds a full copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hwkv.interfaces.communicator import Communicator


@dataclass(frozen=True)
class TPShard:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int
    comm: Communicator


# checkpoint tensor -> (dim, start, length) of the rank's slice, or ZERO: not read, held as zeros
ZERO = None
Slice = tuple[int, int, int]


def check_tp(cfg: Any, size: int) -> None:
    """``ValueError`` listing every reason ``cfg`` (a ModelConfig) cannot be split over ``size`` ranks."""
    if size == 1:
        return
    reasons = []
    h, kv = cfg.num_heads, cfg.num_kv_heads
    if h % size:
        reasons.append(f"num_attention_heads {h} is not divisible by tensor_parallel_size {size}")
    if kv % size and size % kv:
        reasons.append(f"num_key_value_heads {kv} and tensor_parallel_size {size}: one must divide the other "
                       "(KV heads are split when kv >= tp, replicated when kv < tp)")
    if cfg.intermediate_size % size:
        reasons.append(f"intermediate_size {cfg.intermediate_size} is not divisible by tensor_parallel_size {size}")
    moe = cfg.extra.get("moe_intermediate_size", 0)
    if moe % size:
        reasons.append(f"moe_intermediate_size {moe} is not divisible by tensor_parallel_size {size}")
    if reasons:
        allowed = [n for n in range(1, h + 1) if not h % n and not (kv % n and n % kv)
                   and not cfg.intermediate_size % n and not moe % n]
        raise ValueError(f"{cfg.path or 'model'} cannot be split over {size} ranks: " + "; ".join(reasons)
                         + f" (allowed tensor_parallel_size: {', '.join(map(str, allowed))})")


def kv_head_start(num_kv_heads: int, rank: int, size: int) -> int:
    """First KV head of ``rank`` (the only one when ``num_kv_heads < size``)."""
    return rank * num_kv_heads // size


def vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: rank's real vocabulary rows ``[start, end)`` in a shard of ``rows``."""
    rows = -(-vocab // size)
    start = min(rank * rows, vocab)
    return start, min(start + rows, vocab), rows


def local_config(cfg: Any, size: int) -> Any:
    """The per-rank ModelConfig: heads, KV heads and intermediate widths divided (vocab kept: the
    model shards it itself)."""
    extra = dict(cfg.extra)
    if extra.get("moe_intermediate_size"):
        extra["moe_intermediate_size"] //= size
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // size, num_kv_heads=max(1, cfg.num_kv_heads // size),
                               intermediate_size=cfg.intermediate_size // size, extra=extra)


def checkpoint_slices(slots: dict[str, Any], full: Any, shard: TPShard) -> dict[str, Slice | None]:
    """For every sharded checkpoint tensor name in ``slots`` (the model's weight slots, already of
    per-rank shapes): the slice of the checkpoint tensor this rank reads, or ``ZERO``. Names not in
    the result are replicated (read whole)."""
    r, n, d = shard.rank, shard.size, full.head_dim
    kv0 = kv_head_start(full.num_kv_heads, r, n) * d
    out: dict[str, Slice | None] = {}
    for name, view in slots.items():
        parts = name.split(".")
        part, kind = parts[-2], parts[-1]
        if part == "q_proj":
            out[name] = (0, r * view.shape[0], view.shape[0])
        elif part in ("k_proj", "v_proj"):
            out[name] = (0, kv0, view.shape[0])
        elif part in ("gate_proj", "up_proj"):
            out[name] = (0, r * view.shape[0], view.shape[0])
        elif part in ("o_proj", "down_proj"):
            if kind == "bias":
                out[name] = None if r else (0, 0, view.shape[0])
            else:
                out[name] = (1, r * view.shape[1], view.shape[1])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end, _ = vocab_range(full.vocab_size, r, n)
            out[name] = (0, start, end - start)
    return out

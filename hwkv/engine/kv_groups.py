"""KV-cache groups in the engine (docs/hybrid-models.md): whether an engine runs them, which layers share
a block table, how many blocks each group's tensors hold, and the KV cache the model sees.

A model with sliding-window layers runs with one group per attention kind (``hwkv.core.kv_groups``):
each group has its own KV tensors (its layers hold its pool's block count), its own block table per
request (kept by the runner) and its own attention metadata per step (block tables and slot mapping
differ; lengths and query layout are shared). :class:`GroupedKVCache` is what ``kv_cache.layer(i)``
returns through; the runner's ``hwkv.interfaces.attention.GroupedMetadata`` hands layer ``i`` its group's
metadata and slot mapping (``layer_metadata``, the one call a model's layer loop makes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from hwkv.core.kv_groups import KVCacheGroup, layer_groups
from hwkv.interfaces.layout import KVCache, KVCacheSpec


def model_windows(model: Any) -> list[int | None]:
    """The attention window of each decoder layer (``None``: full attention)."""
    mc = model.config
    return [mc.window_of(i) for i in range(mc.num_layers)]


def grouping_blockers(args: Any, connector: Any, model: Any) -> list[str]:
    """Why this engine cannot run ``model`` with KV-cache groups (empty: it can)."""
    reasons = []
    windows = model_windows(model)
    if not any(windows):
        reasons.append("the model has no sliding-window layers (one group is all it has)")
    if connector is not None and not getattr(connector, "supports_kv_groups", False):
        reasons.append(f"the {getattr(connector, 'name', type(connector).__name__)!r} KV connector moves one block "
                       "table per request (allowed: kv_connector None or one that supports KV-cache groups: "
                       "'offload', 'pool', 'p2p')")
    spec = args.speculative_config
    if spec is not None and getattr(spec, "method", None) != "ngram" and None not in windows:
        # a model proposer's KV is indexed by group 0's block ids (the runner's block_table: the full
        # group's when there is one); a window group's table has dropped the blocks its catch-up reads
        reasons.append(f"speculative decoding's {spec.method!r} proposer indexes its KV by the full-attention "
                       "group's block ids, and every layer of this model is windowed (allowed: speculative_config "
                       "None or method 'ngram')")
    return reasons


def window_cap(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
               lookahead: int = 0) -> int:
    """The most blocks a window group's live windows use: per running request its window (and its
    ``lookahead`` speculative slots, held beyond the step's tokens) plus one block either side, plus
    one step's tokens."""
    return (max_num_seqs * (-(-(window - 1 + lookahead) // block_size) + 2)
            + -(-max_num_batched_tokens // block_size))


def plan_groups(model: Any, num_blocks: int, block_size: int, max_num_seqs: int,
                max_num_batched_tokens: int, lookahead: int = 0) -> tuple[KVCacheGroup, ...]:
    """Groups in ``layer_groups`` order. A full group holds ``num_blocks``; a window group what its live
    windows can use at most — every running request's window plus one block either side, plus one
    step's tokens — capped at ``num_blocks`` (a model with no full layer gives its window group the
    whole pool: extra window blocks keep prefixes cached), plus its null block."""
    kinds = layer_groups(model_windows(model))
    has_full = kinds[0][0] is None
    out = []
    for w, layers in kinds:
        n = num_blocks
        if w is not None:  # + its null block (id 0: the table entries before the window), never handed out
            n = 1 + (min(num_blocks, window_cap(w, block_size, max_num_seqs, max_num_batched_tokens, lookahead))
                     if has_full else num_blocks)
        out.append(KVCacheGroup(layers, w, n))
    return tuple(out)


def window_reserve(model: Any, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                   layer_bytes_per_block: int, lookahead: int = 0) -> tuple[int, int]:
    """``(bytes per block of the full layers, bytes of the window groups at their cap)`` for sizing
    the pool: the full group's blocks share what the window groups leave."""
    kinds = layer_groups(model_windows(model))
    full = sum(len(layers) for w, layers in kinds if w is None)
    fixed = sum(len(layers) * layer_bytes_per_block
                * (1 + window_cap(w, block_size, max_num_seqs, max_num_batched_tokens, lookahead))
                for w, layers in kinds if w is not None)
    return full * layer_bytes_per_block, fixed


class GroupedKVCache:
    """The KV tensors of a grouped model: one :class:`KVCache` per group, ``layer(i)`` from layer ``i``'s.

    ``spec`` is the whole model's (every layer) with the first group's usable block count (the full
    group's when there is one: the longest request it can hold); ``caches[g].spec`` each group's own."""

    def __init__(self, groups: tuple[KVCacheGroup, ...], caches: list[KVCache]):
        self.groups, self.caches = groups, caches
        self.where: dict[int, tuple[int, int]] = {layer: (g, j) for g, grp in enumerate(groups)
                                                  for j, layer in enumerate(grp.layers)}
        c0 = caches[0]
        self.layout = c0.layout
        # usable blocks: a window group's null block is never handed out
        self.spec = replace(c0.spec, num_layers=len(self.where),
                            num_blocks=c0.spec.num_blocks - (groups[0].window is not None))
        self.tensors = [t for c in caches for t in c.tensors]

    @classmethod
    def allocate(cls, groups: tuple[KVCacheGroup, ...], spec: KVCacheSpec, device: Any, layout: Any) -> GroupedKVCache:
        return cls(groups, [device.allocate_kv_cache(replace(spec, num_layers=len(g.layers), num_blocks=g.num_blocks),
                                                     layout) for g in groups])

    @property
    def device(self) -> torch.device:
        return self.caches[0].device

    @property
    def scales(self) -> torch.Tensor | None:
        """The first group's (``None``: not quantised); every group's through :meth:`layer_scales`."""
        return self.caches[0].scales

    @property
    def layer_group(self) -> list[int]:
        return [self.where[i][0] for i in range(len(self.where))]

    def layer(self, i: int) -> Any:
        g, j = self.where[i]
        return self.caches[g].layer(j)

    def layer_scales(self, i: int) -> torch.Tensor | None:
        g, j = self.where[i]
        return self.caches[g].layer_scales(j)

    def set_scales(self, scales: torch.Tensor) -> None:
        for g, c in zip(self.groups, self.caches):
            c.set_scales(scales[list(g.layers)])

    def format_key(self) -> str:
        return self.caches[0].format_key()

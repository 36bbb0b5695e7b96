"""Attention interface: backend / metadata-builder / impl split (vLLM v1 style).

Tensor conventions (all on the backend's device):

* ``query``  ``[num_tokens, num_heads, head_size]``
* ``key``, ``value`` (new tokens) ``[num_tokens, num_kv_heads, head_size]``
* output ``[num_tokens, num_heads, head_size]``, dtype of ``query``
* ``layer_kv`` is ``KVCache.layer(i)`` of the layout the backend declared.

Requests in a batch appear in any order and in any of four states, all in one ``forward`` call:
prefill without cached prefix, prefill chunk on a cached prefix (causal over prefix + chunk),
decode (query length 1), and mixtures of these. Query token ``j`` of request ``r`` sits at
absolute position ``seq_lens[r] - query_len[r] + j`` and attends to KV positions ``<=`` its own.
Per-layer parameters on the impl (``None``: off; set by the model right after ``make_impl``, only
when the backend declares them in ``Capabilities.attention_features``): ``window`` - a query at
position ``p`` sees only keys in ``(p - window, p]`` (Mistral / Gemma / GPT-OSS sliding layers);
``softcap`` - scores become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2);
``sinks`` - float32 ``[num_heads]`` learned logits, one per query head, added to the softmax
denominator only (GPT-OSS): ``p_i = exp(s_i) / (exp(sink) + sum_j exp(s_j))``.
Heads are grouped: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hwkv.interfaces.layout import KVCacheSpec, KVLayoutKind


def slot_mapping(block_tables: Any, req_idx: Any, positions: Any, block_size: int) -> Any:
    """KV slot of each new token, ``block_tables[req, pos // bs] * bs + pos % bs`` as int64, for numpy
    arrays or torch tensors alike: the one definition the engine and :meth:`AttentionMetadata.build` use."""
    blocks = block_tables[req_idx, positions // block_size]
    blocks = blocks.astype(np.int64) if isinstance(blocks, np.ndarray) else blocks.long()
    return blocks * block_size + positions % block_size


@dataclass
class AttentionMetadata:
    """Hardware-neutral per-step metadata built by core.

    * ``query_start_loc`` int32 ``[num_reqs + 1]`` cumulative query lengths (starts at 0)
    * ``seq_lens`` int32 ``[num_reqs]`` total KV length per request, new tokens included
    * ``block_tables`` int32 ``[num_reqs, max_blocks]`` physical block ids (padding is unused)
    * ``slot_mapping`` int64 ``[num_tokens]`` ``block_table[p // bs] * bs + p % bs`` for each new
      token's position ``p``; ``-1`` marks a token whose KV must not be written (padding)
    * host (``*_cpu``) copies let backends build their own metadata without a device sync.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_size: int
    num_prefills: int
    num_decodes: int
    num_prefill_tokens: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.numel())

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def context_lens_cpu(self) -> torch.Tensor:
        """KV tokens already cached before this step, per request."""
        return self.seq_lens_cpu - self.query_lens_cpu

    @classmethod
    def build(
        cls,
        query_lens: list[int] | torch.Tensor,
        seq_lens: list[int] | torch.Tensor,
        block_tables: list[list[int]] | torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata in bulk (no per-token Python loop) from per-request lists."""
        ql = torch.as_tensor(query_lens, dtype=torch.int32)
        sl = torch.as_tensor(seq_lens, dtype=torch.int32)
        if ql.numel() != sl.numel():
            raise ValueError(f"{ql.numel()} query lengths but {sl.numel()} seq lengths")
        if bool((ql < 1).any()) or bool((sl < ql).any()):
            raise ValueError("every query length must be >= 1 and <= its seq length")
        if isinstance(block_tables, torch.Tensor):
            bt = block_tables.to("cpu", torch.int32)
        else:
            width = max((len(r) for r in block_tables), default=0)
            bt = torch.zeros((len(block_tables), max(width, 1)), dtype=torch.int32)
            for i, row in enumerate(block_tables):
                bt[i, : len(row)] = torch.as_tensor(row, dtype=torch.int32)
        need = (sl + block_size - 1) // block_size
        if bt.shape[0] != sl.numel() or (sl.numel() and int(need.max()) > bt.shape[1]):
            raise ValueError("block_tables must have one row per request with enough blocks for seq_lens")
        qsl = torch.zeros(ql.numel() + 1, dtype=torch.int32)
        torch.cumsum(ql, 0, out=qsl[1:])
        num_tokens = int(qsl[-1])
        req = torch.repeat_interleave(torch.arange(ql.numel()), ql.long())
        pos = torch.arange(num_tokens) - qsl[:-1].long()[req] + (sl - ql).long()[req]
        slots = slot_mapping(bt, req, pos, block_size)
        is_dec = ql == 1
        dev = torch.device(device)
        return cls(
            query_start_loc=qsl.to(dev),
            seq_lens=sl.to(dev),
            block_tables=bt.to(dev),
            slot_mapping=slots.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=sl,
            block_size=block_size,
            num_prefills=int((~is_dec).sum()),
            num_decodes=int(is_dec.sum()),
            num_prefill_tokens=int(ql[~is_dec].sum()),
            num_decode_tokens=int(ql[is_dec].sum()),
            max_query_len=int(ql.max()) if ql.numel() else 0,
            max_seq_len=int(sl.max()) if sl.numel() else 0,
        )


class AttentionMetadataBuilder:
    """Converts core metadata into the backend's own form (e.g. Ascend cumulative lengths).

    The default passes core metadata through unchanged. Whatever ``build`` returns must expose
    ``slot_mapping`` (the core ``[num_tokens]`` int64 tensor, on the device): the model passes it to
    ``write_kv``. ``build`` must not synchronise with the device (read the ``*_cpu`` tensors), so
    steps can be captured in graphs.

    Optional graph hook ``before_replay(captured, common) -> None``: a builder whose ops take host
    arguments that a captured graph would freeze (lengths passed as host lists) defines it; the
    graph runner calls it before every replay of a decode graph with ``captured`` (what ``build``
    returned at capture, kept with that graph) and ``common`` (this step's core metadata: true host
    lengths, padded rows at length 1) so it can re-bind those arguments inside the graph. It must
    not synchronise with the device either. Builders without it replay the graph as captured.
    """

    def build(self, common: AttentionMetadata) -> Any:
        return common


class AttentionImpl(ABC):
    """Per-layer attention computation: the model makes one instance per layer (vLLM's per-layer
    impl), so per-layer state such as KV scales lives here.

    Quantised KV (``layer_kv`` of a float8 dtype, :mod:`hwkv.interfaces.kv_quant`): ``write_kv``
    stores ``clamp(x / scale, -448, 448)`` rounded to nearest-even and ``forward`` reads ``q * scale``,
    with ``kv_scales`` the layer's float32 ``[2, H_kv]`` K/V scales on the cache's device (the model
    binds ``KVCache.layer_scales(i)``; ``None`` means 1.0). A backend that cannot does not declare
    the dtype in ``Capabilities.kv_cache_dtypes``."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.head_size, self.num_kv_heads, self.scale = num_heads, head_size, num_kv_heads, scale
        self.kv_scales: torch.Tensor | None = None
        # per-layer attention parameters (module docstring); None: off
        self.window: int | None = None
        self.softcap: float | None = None
        self.sinks: torch.Tensor | None = None

    def scales_for(self, layer_kv: Any) -> torch.Tensor:
        """This layer's ``[2, H_kv]`` float32 scales on ``layer_kv``'s device (ones when unbound)."""
        t = layer_kv[0] if isinstance(layer_kv, (tuple, list)) else layer_kv
        if self.kv_scales is None or self.kv_scales.device != t.device:
            if self.kv_scales is not None:
                raise ValueError(f"kv_scales are on {self.kv_scales.device} but the KV cache is on {t.device}")
            self.kv_scales = torch.ones((2, self.num_kv_heads), dtype=torch.float32, device=t.device)
        return self.kv_scales

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        """Scatter new K/V tokens into the paged cache at ``slot_mapping``; slot ``-1`` is skipped.

        Row ``i`` of ``key``/``value`` (``[>= T, H_kv, D]``) goes to ``slot_mapping[i]`` (``[T]``);
        rows past ``T`` are ignored (vLLM's ``reshape_and_cache`` semantics: a padded batch may
        pass longer K/V), fewer rows than ``T`` is a caller error (``ValueError``).

        A slot outside ``[-1, num_blocks * block_size)`` is a caller error; the backend must never
        write outside the cache for it: it raises ``ValueError`` naming the slot (the reference
        does) or, where checking would cost a host sync, skips it (hwkv-cuda, unless
        ``HWKV_CUDA_CHECK_SLOTS=1``)."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_kv: Any,
        metadata: Any,
    ) -> torch.Tensor:
        """Attention of ``query`` over the paged cache (which already holds this step's K/V).

        ``key``/``value`` are this step's new tokens, for backends that attend to them directly
        when no prefix is cached. ``metadata`` is what this backend's builder returned.
        """


class AttentionBackend(ABC):
    """Factory for a backend's attention: its KV layout, metadata builder and impl."""

    name: str = "base"
    kv_layout: KVLayoutKind = KVLayoutKind.PER_LAYER

    def kv_cache_shapes(self, spec: KVCacheSpec) -> list[tuple[int, ...]]:
        return spec.tensor_shapes(self.kv_layout)

    def metadata_builder(self) -> AttentionMetadataBuilder:
        return AttentionMetadataBuilder()

    @abstractmethod
    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> AttentionImpl:
        """An impl for one attention geometry."""


class GroupedMetadata:
    """One step's metadata of a model whose layers are in several KV-cache groups (docs/hybrid-models.md):
    ``per_group[g]`` is ``(what the builder returned, slot_mapping)`` over group ``g``'s block tables,
    ``per_layer[i]`` layer ``i``'s group's. Attributes not found here are the first group's (lengths and
    query layout are the same in every group)."""

    def __init__(self, per_group: list[tuple[Any, torch.Tensor]], layer_group: list[int]):
        self.per_group = per_group
        self.per_layer = [per_group[g] for g in layer_group]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.per_group[0][0], name)


def layer_metadata(attn_metadata: Any, slot_mapping: torch.Tensor, i: int) -> tuple[Any, torch.Tensor]:
    """Layer ``i``'s ``(metadata, slot_mapping)``: its group's under :class:`GroupedMetadata`, else as given."""
    if type(attn_metadata) is GroupedMetadata:
        return attn_metadata.per_layer[i]
    return attn_metadata, slot_mapping

"""Ascend attention through torch_npu ops (vllm-ascend ``attention_v1.py`` semantics).

* KV write: ``npu_scatter_pa_kv_cache(cache_mode="Norm")`` on this step's real tokens only.
* Decode-only batches: ``_npu_paged_attention`` (ATB PagedAttention) where it takes the head size
  (``block_size * head_size <= 128 * 128``), else FIA like the other states.
* Everything else: ``npu_fused_infer_attention_score`` (FIA) in TND layout, ``sparse_mode=3``
  (right-down causal) with the 2048x2048 int8 upper-triangular mask; with no cached prefix it reads
  this step's raw K/V (``block_table=None``, cumulative KV lengths), otherwise the paged cache viewed
  as ``(num_blocks, block_size, H_kv*D)`` with per-request KV lengths.
* Sliding-window layers (``impl.window = w``: a query at ``p`` sees keys ``(p - w, p]``): FIA in every
  state, decode included (ATB PagedAttention takes no window), with the band mode ``sparse_mode=4``
  (same compressed mask), ``pre_tokens = w - 1`` and ``next_tokens = 0``: FIA's band keeps, right-down
  aligned, the keys ``[p - pre_tokens, p + next_tokens]`` (the op documentation's band rule; vllm-ascend
  passes ``pre_tokens = w``, which by that rule keeps ``w + 1`` keys). Which edge the kernel keeps is
  what a run on an NPU must confirm (``hwkv conformance --backend ascend``: the window case has a
  13-key window beside > 4096-token contexts). Logit soft-caps and attention sinks have no FIA or
  ATB input: refused by name (``Capabilities.attention_features``) and here.

Per-step conversion happens once in :class:`AscendMetadataBuilder` from core's host tensors;
the per-layer ``forward`` only launches ops.

ACL graphs (vllm-ascend's full decode graphs): both attention ops take their lengths as host values
(FIA's ``actual_seq_lengths(_kv)`` lists, ATB's host ``context_lens``), which a captured graph
freezes. Under capture each layer's op is launched inside a graph task group
(``graph_task_group_begin/end``) behind an ``ExternalEvent`` wait; before every replay
:meth:`AscendMetadataBuilder.before_replay` re-issues it on an update stream between
``graph_task_update_begin/end`` with the step's lengths (same tensors, outputs and workspace) and
records the event — vllm-ascend's ``update_attn_params``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hwkv.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    KVCacheSpec,
    KVLayoutKind,
)
from hwkv_ascend import _npu

BLOCK_SIZE = 128  # FIA page attention: block_size multiple of 128 in [128, 512]; ATB PA: bs*D <= 128*128
MASK_SIZE = 2048  # sparse_mode 2/3/4 take a fixed 2048x2048 "optimised" mask
RECENT_STEPS = 8  # metadata kept for KV writes to recognise: one per KV-cache group of a step (and a few more)
# FIA in TND layout (every prefill, prefix-hit and mixed step) takes only these head dims
# (ops-transformer prompt-flash-attention tiling; the op's error 561002 "input_layout is TND, only
# headDim = 64/128/192 are supported"). MLA's q/k 192 with v 128 needs split head dims: not offered.
HEAD_SIZES = (64, 128, 192)
PA_MAX_BLOCK_X_HEAD = 128 * 128  # ATB PagedAttention: block_size * head_size <= 128 * 128


class AscendAttentionState(enum.Enum):
    PREFILL_NO_CACHE = "prefill_no_cache"  # every request starts at position 0: raw K/V, no block table
    PREFILL_CACHE_HIT = "prefill_cache_hit"  # prefill chunks on cached prefixes, no decodes: paged FIA
    DECODE_ONLY = "decode_only"  # every query length is 1: ATB paged attention
    CHUNKED_PREFILL = "chunked_prefill"  # mixed prefill chunks and decodes: paged FIA


@dataclass
class AscendMetadata:
    """One step's metadata in the form the ops take. Lists are host values (SymInt[] arguments)."""

    state: AscendAttentionState
    num_actual_tokens: int  # tokens of real requests; the rest (if any) belong to the dummy request
    num_tokens: int  # rows of query / key / value == actual_seq_lengths_q[-1]
    actual_seq_lengths_q: list[int]  # cumulative query ends (TND), dummy request included
    seq_lens_list: list[int]  # per-request KV length, dummy request included
    seq_lens: torch.Tensor  # int32 host tensor of seq_lens_list (ATB context_lens)
    block_tables: torch.Tensor  # int32 device [num_reqs (+ dummy), max_blocks]
    slot_mapping: torch.Tensor
    attn_mask: torch.Tensor  # int8 device [2048, 2048], 1 = masked
    block_size: int
    num_prefills: int
    num_decodes: int
    # captured attention launches of the graph this metadata was captured with (one per layer)
    graph_tasks: list[GraphTask] = field(default_factory=list)
    live: Any = None  # the metadata of the last update: its host tensors outlive the update's launch

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)


@dataclass
class GraphTask:
    """One captured attention launch: its task-group handle, the event the graph waits on before
    it, and ``launch(metadata)`` re-issuing the op (same tensors) with that metadata's lengths."""

    handle: Any
    event: Any
    launch: Callable[[AscendMetadata], None]


class AscendMetadataBuilder(AttentionMetadataBuilder):
    """Core metadata → :class:`AscendMetadata`, from the ``*_cpu`` tensors only (no device sync).

    The TND layout needs ``sum(query lengths) == query rows``: when core pads the token dimension
    (slot ``-1`` tail), a dummy request of the missing length is appended (KV length 1, block 0 —
    its output rows are padding and its K/V are never written).

    ``step`` is the last metadata built and ``recent`` the last few (a step of a model in several
    KV-cache groups builds one per group, each with its own slot mapping): the impls of every layer
    find theirs by its slot mapping and read its real-token count to slice their KV writes (one
    builder per backend, shared by all impls).
    """

    def __init__(self) -> None:
        self._masks: dict[torch.device, torch.Tensor] = {}
        self.step: AscendMetadata | None = None
        self.recent: collections.deque[AscendMetadata] = collections.deque(maxlen=RECENT_STEPS)
        self._update_stream: Any = None

    def mask(self, device: torch.device) -> torch.Tensor:
        if device not in self._masks:
            self._masks[device] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8), diagonal=1).to(device)
        return self._masks[device]

    def build(self, common: AttentionMetadata) -> AscendMetadata:
        if common.block_size != BLOCK_SIZE:
            raise ValueError(
                f"block_size {common.block_size} not supported by the Ascend ops (allowed: exactly {BLOCK_SIZE})"
            )
        qsl = common.query_start_loc_cpu.to(torch.int64)
        seq_lens = common.seq_lens_cpu.to(torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        context_lens = seq_lens - query_lens
        num_actual = int(qsl[-1])
        num_tokens = common.num_tokens
        if num_tokens < num_actual:
            raise ValueError(f"slot_mapping has {num_tokens} tokens but query_start_loc sums to {num_actual}")
        if bool((context_lens < 0).any()):
            raise ValueError("seq_lens must be >= the query length of every request")

        if bool((context_lens == 0).all()):
            state = AscendAttentionState.PREFILL_NO_CACHE
        elif bool((query_lens == 1).all()):
            state = AscendAttentionState.DECODE_ONLY
        elif common.num_decodes == 0:
            state = AscendAttentionState.PREFILL_CACHE_HIT
        else:
            state = AscendAttentionState.CHUNKED_PREFILL

        cum_q = qsl[1:].tolist()
        kv = seq_lens.tolist()
        block_tables = common.block_tables
        pad = num_tokens - num_actual
        if pad:
            # ATB PA (decode-only) takes one row per *token*: pad with 1-token requests there.
            dummy = [1] * pad if state is AscendAttentionState.DECODE_ONLY else [pad]
            cum_q += list(itertools.accumulate(dummy, initial=num_actual))[1:]
            kv += [1] * len(dummy)
            block_tables = torch.cat([block_tables, block_tables.new_zeros((len(dummy), block_tables.shape[1]))])
        self.step = AscendMetadata(
            state=state,
            num_actual_tokens=num_actual,
            num_tokens=num_tokens,
            actual_seq_lengths_q=cum_q,
            seq_lens_list=kv,
            seq_lens=torch.tensor(kv, dtype=torch.int32),
            block_tables=block_tables,
            slot_mapping=common.slot_mapping,
            attn_mask=self.mask(block_tables.device),
            block_size=common.block_size,
            num_prefills=common.num_prefills,
            num_decodes=common.num_decodes,
        )
        self.recent.append(self.step)
        return self.step

    def before_replay(self, captured: AscendMetadata, common: AttentionMetadata) -> None:
        """Re-bind the host lengths of every attention launch captured with ``captured`` to this
        step's (the graph runner calls it before each replay; vllm-ascend's ``update_attn_params``).

        The update runs on its own stream after the current stream's work (the previous replay
        reads the tasks being rewritten), and records each task's event, which the graph waits on
        before that task."""
        if not captured.graph_tasks:
            return
        step = self.build(common)
        if step.num_tokens != captured.num_tokens or bool((common.query_lens_cpu != 1).any()):
            raise ValueError(f"graph captured for {captured.num_tokens} one-token queries, replayed for "
                             f"{step.num_tokens} tokens with query lengths {common.query_lens_cpu.tolist()}")
        # one-token queries whose KV the graph has just written: the captured decode ops serve them
        # even when no request has context yet (a batch of one-token prompts builds PREFILL_NO_CACHE)
        step = dataclasses.replace(step, state=captured.state, graph_tasks=[])
        rt = _npu.torch_npu().npu
        if self._update_stream is None:
            self._update_stream = rt.Stream()
        s = self._update_stream
        s.wait_stream(rt.current_stream())
        with rt.stream(s):
            for task in captured.graph_tasks:
                rt.graph_task_update_begin(s, task.handle)
                task.launch(step)
                rt.graph_task_update_end(s)
                task.event.record(s)
        captured.live = step


MAX_HEADS = 256  # FIA: num_heads <= 256 (prompt-flash-attention tiling NLIMIT)
ATTENTION_FEATURES = ("sliding_window",)  # FIA's band mode (module docstring)
FEATURES_REASON = ("npu_fused_infer_attention_score and ATB PagedAttention have no logit soft-cap and no "
                   "attention-sink input (allowed: sliding_window, through FIA's band mode)")


def check_geometry(num_heads: int, head_size: int) -> None:
    if head_size not in HEAD_SIZES:
        raise ValueError(
            f"head_size {head_size} not supported by the Ascend attention ops: npu_fused_infer_attention_score "
            f"in TND layout takes only {'/'.join(map(str, HEAD_SIZES))} (allowed: {list(HEAD_SIZES)})"
        )
    if num_heads > MAX_HEADS:
        raise ValueError(f"num_heads {num_heads} not supported by npu_fused_infer_attention_score "
                         f"(allowed: at most {MAX_HEADS} per device)")


class AscendAttentionImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 builder: AscendMetadataBuilder):
        check_geometry(num_heads, head_size)
        super().__init__(num_heads, head_size, num_kv_heads, scale)
        self.builder = builder
        # ATB PagedAttention serves decode-only steps where it takes the head size; FIA otherwise.
        self.use_paged_attention = BLOCK_SIZE * head_size <= PA_MAX_BLOCK_X_HEAD

    def _real_rows(self, slot_mapping: torch.Tensor) -> slice | torch.Tensor:
        """Rows of this step's K/V that carry a real token, as vllm-ascend slices its KV write
        (``[:num_actual_tokens]``) instead of handing the kernel padding slots (-1): whether the
        kernel skips them is only confirmed on A3 with CANN 9.

        On the engine's step path the slot mapping is one the builder saw (a KV-cache group's own,
        among ``recent``): its real tokens come first and their count is host-known. (``recent``
        holds those tensors, so their memory cannot be reused by another; a graph replay must
        rebuild the step's metadata, which FIA's host length lists need anyway.) Any other slot
        mapping (a direct call) is read on the host once to find its non-negative slots."""
        n = slot_mapping.shape[0]
        for step in reversed(self.builder.recent):
            if (n == step.num_tokens and step.slot_mapping.device == slot_mapping.device
                    and step.slot_mapping.data_ptr() == slot_mapping.data_ptr()):
                return slice(0, step.num_actual_tokens)
        keep = slot_mapping.cpu() >= 0  # off the step path only: one host read
        if bool(keep.all()):
            return slice(0, n)
        return keep.nonzero().flatten().to(slot_mapping.device)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = layer_kv
        rows = self._real_rows(slot_mapping)
        key, value, slot_mapping = key[rows], value[rows], slot_mapping[rows]
        if slot_mapping.shape[0] == 0:
            return
        _npu.torch_npu().npu_scatter_pa_kv_cache(
            key=key.contiguous(),
            value=value.contiguous(),
            key_cache=key_cache,
            value_cache=value_cache,
            slot_mapping=slot_mapping.contiguous(),
            cache_mode="Norm",  # ND [num_blocks, block_size, H_kv, D]; the op's default is PA_NZ
        )

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, metadata: Any
    ) -> torch.Tensor:
        md: AscendMetadata = metadata
        npu = _npu.torch_npu()
        query = query.contiguous()
        if self.softcap is not None or self.sinks is not None:
            what = "logit soft-cap" if self.softcap is not None else "sinks"
            raise ValueError(f"the Ascend attention ops take no {what} ({FEATURES_REASON})")
        # ATB PagedAttention has no window: a window layer decodes through FIA's band mode
        paged = md.state is AscendAttentionState.DECODE_ONLY and self.use_paged_attention and self.window is None
        args = self._pa_args(query, layer_kv, md) if paged else self._fia_args(query, key, value, layer_kv, md)
        if _npu.capturing(npu):
            return self._captured(npu, query, args, paged, md)
        if paged:
            out = torch.empty_like(query)
            npu._npu_paged_attention(**args, out=out)
            return out
        out, _ = npu.npu_fused_infer_attention_score(**args)
        return out.view(query.shape[0], self.num_heads, self.head_size)

    def _pa_args(self, query: torch.Tensor, layer_kv: Any, md: AscendMetadata) -> dict[str, Any]:
        key_cache, value_cache = layer_kv
        return dict(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=self.num_kv_heads,
                    num_heads=self.num_heads, scale_value=self.scale, block_table=md.block_tables,
                    context_lens=md.seq_lens)

    def _fia_args(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any,
                  md: AscendMetadata) -> dict[str, Any]:
        key_cache, value_cache = layer_kv
        if md.state is AscendAttentionState.PREFILL_NO_CACHE:
            k, v = key.contiguous(), value.contiguous()
            block_table, block_size = None, md.block_size
        else:
            nb, bs = key_cache.shape[:2]
            k, v = key_cache.view(nb, bs, -1), value_cache.view(nb, bs, -1)
            block_table, block_size = md.block_tables, bs
        band = {} if self.window is None else dict(sparse_mode=4, pre_tokens=self.window - 1, next_tokens=0)
        return dict(query=query, key=k, value=v, atten_mask=md.attn_mask, block_table=block_table,
                    input_layout="TND", block_size=block_size, actual_seq_lengths=md.actual_seq_lengths_q,
                    actual_seq_lengths_kv=_kv_lens(md), num_key_value_heads=self.num_kv_heads,
                    num_heads=self.num_heads, scale=self.scale, **{"sparse_mode": 3, **band})

    def _captured(self, npu: Any, query: torch.Tensor, args: dict[str, Any], paged: bool,
                  md: AscendMetadata) -> torch.Tensor:
        """The op launched as a graph task group (its host lengths re-bound per replay by
        :meth:`AscendMetadataBuilder.before_replay`). The workspace is sized at capture, where the
        graph runner sets every length to the graph's bound, so every replay's lengths fit."""
        rt = npu.npu
        out = torch.empty_like(query)
        if paged:
            ws = npu._npu_paged_attention_get_workspace(**args)

            def launch(m: AscendMetadata) -> None:
                npu._npu_paged_attention(**{**args, "context_lens": m.seq_lens}, out=out, workspace=ws)
        else:
            ws = npu._npu_fused_infer_attention_score_get_max_workspace(**args)
            lse = torch.empty(1, dtype=query.dtype, device=query.device)

            def launch(m: AscendMetadata) -> None:
                npu.npu_fused_infer_attention_score.out(
                    **{**args, "actual_seq_lengths": m.actual_seq_lengths_q, "actual_seq_lengths_kv": _kv_lens(m)},
                    workspace=ws, out=[out, lse])
        stream = rt.current_stream()
        event = rt.ExternalEvent()
        event.wait(stream)  # the replay runs this task only after the update recorded the event
        event.reset(stream)
        rt.graph_task_group_begin(stream)
        launch(md)
        handle = rt.graph_task_group_end(stream)
        md.graph_tasks.append(GraphTask(handle, event, launch))
        return out


def _kv_lens(md: AscendMetadata) -> list[int]:
    """FIA's ``actual_seq_lengths_kv``: cumulative like the query's for raw TND K/V (no cached
    prefix), per-request KV lengths for the paged cache."""
    return md.actual_seq_lengths_q if md.state is AscendAttentionState.PREFILL_NO_CACHE else md.seq_lens_list


class AscendAttentionBackend(AttentionBackend):
    name = "ascend"
    kv_layout = KVLayoutKind.SEPARATE_KV

    def __init__(self, soc: str = "A2"):
        self.soc = soc
        self._builder = AscendMetadataBuilder()  # shared: the mask is built once per device

    def kv_cache_shapes(self, spec: KVCacheSpec) -> list[tuple[int, ...]]:
        return spec.tensor_shapes(self.kv_layout)

    def metadata_builder(self) -> AscendMetadataBuilder:
        return self._builder

    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> AscendAttentionImpl:
        return AscendAttentionImpl(num_heads, head_size, num_kv_heads, scale, self._builder)

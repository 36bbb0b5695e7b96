"""A CPU emulation of the torch_npu ops hwkv-ascend calls — for tests only.

Written from the op documentation and sources, not from any other backend; each rule names where it
was read:

* [FIA-doc] Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md`` and the
  schema in ``op_plugin/config/op_plugin_functions.yaml`` (keyword-only after ``value``, fp16/bf16,
  contiguity, TND length rules, ``sparse_mode=3`` with the fixed 2048x2048 mask, page attention:
  int32 block table, block_size a multiple of 128 in [128, 512], GQA ratio <= 64). [FIA-band]: the
  same document's ``sparse_mode=4`` (band) takes the same compressed mask and keeps, right-down
  aligned, the keys ``[p - pre_tokens, p + next_tokens]`` of a query at ``p`` (both edges included);
  ``pre_tokens`` / ``next_tokens`` mean nothing in modes 2/3. Negative bounds and a band in mode 0 (a
  full mask) are not emulated. The included edge is this reading of the document, not a run.
* [PFA-tiling] hicann/ops-transformer ``attention/prompt_flash_attention/op_host/
  prompt_flash_attention_tiling.cpp`` (which FIA's TND path runs through): TND takes head dims
  64/128/192 only; the text of its error is what aclnnFusedInferAttentionScoreV3 reports (561002).
* [SCATTER-doc] op-plugin ``docs/context/torch_npu-npu_scatter_pa_kv_cache.md`` and yaml:
  ``cache_mode`` ('Norm' = ND, default 'PA_NZ'), int32/int64 unique slots, contiguous inputs.
* [SCATTER-versions] vllm-project/vllm-ascend ``vllm_ascend/device/device_op.py`` history: the first
  ``cache_mode="Norm"`` call lands 2026-04-21 (a59a13cd0d), torch-npu 2.10.0 is pinned 2026-05-14
  (3f73174317); torch_npu 2.8/2.9 have no ``cache_mode`` (calling with it is a TypeError).
* [SCATTER-neg] negative slots are skipped by the kernel only as confirmed on A3 with CANN 9
  (op-plugin ``test/test_custom_ops/test_scatter_pa_kv_cache.py`` golden ``if slot < 0: continue``);
  elsewhere the emulator rejects them, so a caller relying on the skip fails in CI.
* [PA-atb] op-plugin ``op_plugin/ops/atb/PagedAttentionAtb.cpp`` and CANN ATB
  ``PagedAttentionOperation``: BSND query, ND caches, int32 tables/lengths, block_size % 16 == 0,
  head_size <= 256, block_size * head_size <= 128 * 128.
* [CANN] older CANN rejects TND with page attention (vllm-ascend's CANN 9 requirement);
  ``torch_npu.npu.utils.get_cann_version`` per op-plugin ``docs/context/
  torch_npu-npu-utils-get_cann_version.md``.
* [SOC] ``torch_npu.npu.get_soc_version()`` families as vllm-ascend ``device/hardware.py`` reads them.
* Dense ops (RMSNorm, RoPE, SwiGLU): see ``npu_emulator_dense.py``.
* ACL graphs (capture, task groups, task updates, frozen host arguments): ``npu_emulator_graph.py``.

Features hwkv does not use (quantisation, NZ format, other layouts, rope, pse) raise
``NotImplementedError`` instead of guessing.

Install with ``sys.modules["torch_npu"] = make_module(...)``: the backend then runs on the CPU
(``HWKV_EMULATED`` tells it so). Math runs in float32 and rounds the output once to the input dtype.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

HALF = (torch.float16, torch.bfloat16)
INT_MAX = 2147483647
TND_HEAD_DIMS = (64, 128, 192)  # [PFA-tiling]
_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Chip:
    """What the emulated install is: SoC number, CANN version, torch_npu version."""

    soc_version: int = 222  # A2 (910B3)
    cann: str = "9.0.0"
    version: str = "2.10.0+emulated"

    @property
    def family(self) -> str:  # [SOC]
        for lo, hi, name in ((200, 205, "310P"), (220, 225, "A2"), (250, 255, "A3"), (260, 260, "A5")):
            if lo <= self.soc_version <= hi:
                return name
        return "unknown"

    def _ver(self, text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", text)[:3])

    @property
    def cann_major(self) -> int:
        return self._ver(self.cann)[0]

    @property
    def has_cache_mode(self) -> bool:  # [SCATTER-versions]
        return self._ver(self.version) >= (2, 10, 0)

    @property
    def skips_negative_slots(self) -> bool:  # [SCATTER-neg]
        return self.family == "A3" and self.cann_major >= 9


DEFAULT_CHIP = Chip()

# FIA keywords that exist in the real signature but are not emulated: allowed only at their default.
_FIA_UNEMULATED = (
    "pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
    "antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset",
    "value_antiquant_scale", "value_antiquant_offset", "query_padding_size", "kv_padding_size",
    "key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len", "query_rope", "key_rope",
    "key_rope_antiquant_scale", "antiquant_mode", "key_antiquant_mode", "value_antiquant_mode",
)


class NpuOpError(RuntimeError):
    """What a real op reports as an aclnn/ATB error (a RuntimeError in torch_npu)."""


def _contiguous(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_contiguous():
            raise NpuOpError(f"{name}: non-contiguous tensors are not supported")


def _int_list(name: str, v: object) -> list[int]:
    if isinstance(v, torch.Tensor) or not isinstance(v, Sequence):
        raise TypeError(f"{name} must be a list of ints (SymInt[]), got {type(v).__name__}")
    return [int(x) for x in v]


def _cumulative(name: str, ends: list[int]) -> list[int]:
    """Lengths from cumulative ends; must be non-negative and non-decreasing."""
    prev, out = 0, []
    for e in ends:
        if e < prev:
            raise NpuOpError(f"{name} must be cumulative (non-decreasing, >= 0), got {ends}")
        out.append(e - prev)
        prev = e
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None,
            band: tuple[int, int] | None = None) -> torch.Tensor:
    """q [Sq, N, D], k/v [Skv, Nkv, D] → [Sq, N, D] float32. ``causal_offset`` = Skv - Sq for the
    right-down causal mask (query row i sees KV j <= i + offset); ``band`` = (pre, next) instead keeps
    ``i + offset - pre <= j <= i + offset + next`` [FIA-band]; fully masked rows give 0."""
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, dim=1)
    v = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qnd,knd->nqk", q.float(), k) * scale
    if causal_offset is not None:
        i = torch.arange(q.shape[0]).unsqueeze(1)
        j = torch.arange(k.shape[0]).unsqueeze(0)
        pre, nxt = band if band is not None else (None, 0)
        s = s.masked_fill(j > i + causal_offset + nxt, float("-inf"))
        if pre is not None:
            s = s.masked_fill(j < i + causal_offset - pre, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # all -inf rows → 0
    return torch.einsum("nqk,knd->qnd", p, v)


@functools.lru_cache(maxsize=1)
def _triu_2048() -> torch.Tensor:
    return torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)


def _check_mask(atten_mask: torch.Tensor | None, sparse_mode: int) -> None:
    if sparse_mode == 0:
        if atten_mask is not None:
            raise NotImplementedError("sparse_mode=0 with a full atten_mask is not emulated")
        return
    if sparse_mode not in (3, 4):
        raise NpuOpError(f"TND supports sparse_mode=0 without mask or sparse_mode=3/4 with mask, got {sparse_mode}")
    if atten_mask is None:
        raise NpuOpError(f"sparse_mode={sparse_mode} requires atten_mask (the optimised 2048x2048 mask)")
    _contiguous(atten_mask=atten_mask)
    if atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise NpuOpError(f"atten_mask dtype must be bool/int8/uint8, got {atten_mask.dtype}")
    m = atten_mask.reshape(atten_mask.shape[-2:]) if atten_mask.dim() in (3, 4) else atten_mask
    if tuple(m.shape) != (2048, 2048) or atten_mask.numel() != 2048 * 2048:
        raise NpuOpError(f"sparse_mode=3 needs a (2048, 2048) atten_mask, got {tuple(atten_mask.shape)}")
    if not torch.equal(m.to(torch.int8).cpu(), _triu_2048()):
        raise NpuOpError("atten_mask must be the upper-triangular mask (1 = masked above the diagonal)")


def npu_fused_infer_attention_score(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    block_table: torch.Tensor | None = None,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = INT_MAX,
    next_tokens: int = INT_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    block_size: int = 0,
    softmax_lse_flag: bool = False,
    _chip: Chip = DEFAULT_CHIP,
    **features: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    for name, val in features.items():
        if name not in _FIA_UNEMULATED:
            raise TypeError(f"npu_fused_infer_attention_score() got an unexpected keyword argument {name!r}")
        if val not in (None, 0):
            raise NotImplementedError(f"{name} is not emulated")
    if softmax_lse_flag:
        raise NotImplementedError("softmax_lse_flag=True is not emulated")
    if input_layout != "TND":
        raise NotImplementedError(f"input_layout {input_layout!r} is not emulated (TND only)")
    if inner_precise not in (0, 1, 2, 3):
        raise NpuOpError(f"inner_precise must be 0..3, got {inner_precise}")
    _contiguous(query=query, key=key, value=value, block_table=block_table)
    if query.dtype not in HALF:
        raise NpuOpError(f"query dtype must be float16/bfloat16, got {query.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise NpuOpError(f"key/value dtype {key.dtype}/{value.dtype} must match query dtype {query.dtype}")
    if query.dim() != 3 or query.shape[1] != num_heads:
        raise NpuOpError(f"TND query must be [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
    nkv = num_key_value_heads or num_heads
    if num_heads % nkv or num_heads // nkv > 64:
        raise NpuOpError(f"num_heads {num_heads} must be a multiple of num_key_value_heads {nkv}, ratio <= 64")
    if num_heads > 256:  # [PFA-tiling] NLIMIT
        raise NpuOpError(f"num_heads {num_heads} must be <= 256")
    t, _, d = query.shape
    if d not in TND_HEAD_DIMS:  # [PFA-tiling], the op's own text
        raise NpuOpError(f"input_layout is TND, only headDim = 64/128/192 are supported, but got {d}")
    if block_table is not None and _chip.cann_major < 9:  # [CANN]
        raise NpuOpError(f"CANN {_chip.cann}: input_layout TND does not support page attention (block_table)")
    if actual_seq_lengths is None or actual_seq_lengths_kv is None:
        raise NpuOpError("TND layout requires actual_seq_lengths and actual_seq_lengths_kv")
    q_ends = _int_list("actual_seq_lengths", actual_seq_lengths)
    q_lens = _cumulative("actual_seq_lengths", q_ends)
    if not q_ends or q_ends[-1] != t:
        raise NpuOpError(
            f"TND: actual_seq_lengths[-1] ({q_ends[-1] if q_ends else None}) must equal the query token count {t}"
        )
    batch = len(q_ends)
    if batch > 65536:  # [PFA-tiling] BLIMIT
        raise NpuOpError(f"batch {batch} must be <= 65536")
    kv_arg = _int_list("actual_seq_lengths_kv", actual_seq_lengths_kv)
    if len(kv_arg) != batch:
        raise NpuOpError(f"actual_seq_lengths_kv has {len(kv_arg)} entries, batch (len(actual_seq_lengths)) is {batch}")
    _check_mask(atten_mask, sparse_mode)
    band = None
    if sparse_mode == 4:  # [FIA-band]
        if pre_tokens < 0 or next_tokens < 0:
            raise NotImplementedError(f"negative band bounds (pre_tokens {pre_tokens}, next_tokens {next_tokens}) "
                                      "are not emulated")
        band = (pre_tokens, next_tokens)
    elif sparse_mode == 0 and (pre_tokens, next_tokens) != (INT_MAX, INT_MAX):
        raise NotImplementedError("pre_tokens / next_tokens with sparse_mode=0 are not emulated")

    if block_table is not None:  # page attention: per-request KV lengths into (blocks, block_size, H*D)
        kv_lens = kv_arg
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise NpuOpError(f"block_table must be int32 [batch={batch}, max_blocks], got {block_table.dtype} "
                             f"{tuple(block_table.shape)}")
        if key.dim() != 3 or key.shape != value.shape:
            raise NotImplementedError("paged key/value must be (num_blocks, block_size, H*D) (BNSD not emulated)")
        nb, bs, hd = key.shape
        if block_size != bs or bs % 128 or not 128 <= bs <= 512:
            raise NpuOpError(f"block_size {block_size} must equal the cache's {bs}, a multiple of 128 in [128, 512]")
        if hd != nkv * d:
            raise NpuOpError(f"paged K/V last dim {hd} != num_key_value_heads*D = {nkv * d}")
        if any(n < 0 or n > block_table.shape[1] * bs for n in kv_lens):
            raise NpuOpError(f"actual_seq_lengths_kv {kv_lens} exceed block_table capacity {block_table.shape[1] * bs}")
        if sum(-(-n // bs) for n in kv_lens) > nb:
            raise NpuOpError("num_blocks is smaller than the blocks the KV lengths need")
        bt = block_table.cpu().long()

        def kv_of(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            ids = bt[b, : -(-kv_lens[b] // bs)]
            if bool(((ids < 0) | (ids >= nb)).any()):
                raise NpuOpError(f"block id out of [0, {nb}) in block_table row {b}")
            return (key[ids].reshape(-1, nkv, d)[: kv_lens[b]], value[ids].reshape(-1, nkv, d)[: kv_lens[b]])
    else:  # raw TND K/V: KV lengths are cumulative ends into key/value rows, like the query's
        if key.dim() != 3 or key.shape[1:] != (nkv, d) or key.shape != value.shape:
            raise NpuOpError(f"TND key/value must be [T_kv, {nkv}, {d}], got {tuple(key.shape)}/{tuple(value.shape)}")
        kv_lens = _cumulative("actual_seq_lengths_kv", kv_arg)
        if kv_arg[-1] != key.shape[0]:
            raise NpuOpError(f"TND: actual_seq_lengths_kv[-1] ({kv_arg[-1]}) != key token count {key.shape[0]}")
        starts = [e - n for e, n in zip(kv_arg, kv_lens)]

        def kv_of(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            return key[starts[b] : kv_arg[b]], value[starts[b] : kv_arg[b]]

    out = torch.zeros(t, num_heads, d, dtype=torch.float32)
    q0 = 0
    for b in range(batch):
        q1 = q0 + q_lens[b]
        if q_lens[b] and kv_lens[b]:
            k, v = kv_of(b)
            out[q0:q1] = _attend(query[q0:q1], k, v, scale, kv_lens[b] - q_lens[b] if sparse_mode else None, band)
        q0 = q1
    return out.to(query.dtype), torch.zeros(1)  # softmax_lse_flag=False: a [1] zero tensor


def _npu_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    num_heads: int,
    scale_value: float,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor,
    workspace: torch.Tensor | None = None,
) -> None:
    """ATB PagedAttentionOperation (decode): one query token per row attends its whole context."""
    _contiguous(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table, out=out)
    if query.dtype not in HALF or key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise NpuOpError(f"query/key_cache/value_cache must share a float16/bfloat16 dtype, got "
                         f"{query.dtype}/{key_cache.dtype}/{value_cache.dtype}")
    if query.dim() != 3 or query.shape[1] != num_heads:
        raise NpuOpError(f"query must be [num_tokens, num_heads={num_heads}, head_size], got {tuple(query.shape)}")
    nkv = num_kv_heads or num_heads
    if num_heads % nkv:
        raise NpuOpError(f"num_heads {num_heads} must be a multiple of num_kv_heads {nkv}")
    t, _, d = query.shape
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape or key_cache.shape[2:] != (nkv, d):
        raise NpuOpError(f"caches must be ND [num_blocks, block_size, {nkv}, {d}], got {tuple(key_cache.shape)}")
    nb, bs = key_cache.shape[:2]
    if bs % 16 or not 0 < d <= 256 or bs * d > 128 * 128:
        raise NpuOpError(f"block_size {bs} / head_size {d}: need block_size % 16 == 0, head_size <= 256, "
                         "block_size * head_size <= 128 * 128")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != t:
        raise NpuOpError(f"block_table must be int32 [num_tokens={t}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if context_lens.dtype != torch.int32 or tuple(context_lens.shape) != (t,):
        raise NpuOpError(f"context_lens must be int32 [num_tokens={t}], got {context_lens.dtype} "
                         f"{tuple(context_lens.shape)}")
    if out.shape != query.shape or out.dtype != query.dtype:
        raise NpuOpError("out must have the query's shape and dtype")
    lens, bt = context_lens.cpu().tolist(), block_table.cpu().long()
    for i, n in enumerate(lens):
        if not 0 < n <= bt.shape[1] * bs:
            raise NpuOpError(f"context_lens[{i}]={n} outside (0, {bt.shape[1] * bs}]")
        ids = bt[i, : -(-n // bs)]
        if bool(((ids < 0) | (ids >= nb)).any()):
            raise NpuOpError(f"block id out of [0, {nb}) in block_table row {i}")
        k = key_cache[ids].reshape(-1, nkv, d)[:n]
        v = value_cache[ids].reshape(-1, nkv, d)[:n]
        out[i] = _attend(query[i : i + 1], k, v, scale_value, None)[0].to(out.dtype)


def _scatter(key, value, key_cache, value_cache, slots: torch.Tensor, chip: Chip) -> None:
    nb, bs = key_cache.shape[:2]
    s = slots.cpu().long()
    if bool((s >= nb * bs).any()) or (bool((s < 0).any()) and not chip.skips_negative_slots):
        raise NpuOpError(f"slot_mapping values must lie in [0, {nb * bs}) (negative slots are skipped only on "
                         f"A3 with CANN >= 9; this is {chip.family} with CANN {chip.cann})")  # [SCATTER-neg]
    keep = s >= 0
    s = s[keep]
    if s.unique().numel() != s.numel():
        raise NpuOpError("slot_mapping values must be unique")
    kf, vf = key_cache.view(nb * bs, *key_cache.shape[2:]), value_cache.view(nb * bs, *value_cache.shape[2:])
    kf[s] = key[keep.to(key.device)]
    vf[s] = value[keep.to(value.device)]


def _check_write(key, value, key_cache, value_cache) -> None:
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise NpuOpError(f"key/value must be [num_tokens, H, D] with equal first dims, got {tuple(key.shape)}/"
                         f"{tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        raise NpuOpError(f"caches must be ND [num_blocks, block_size, H, D] matching key/value, got "
                         f"{tuple(key_cache.shape)}/{tuple(value_cache.shape)}")
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise NpuOpError("key, value, key_cache and value_cache must share one dtype")


def npu_scatter_pa_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    compress_lens: torch.Tensor | None = None,
    compress_seq_offsets: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    cache_mode: str | None = "PA_NZ",
    _chip: Chip = DEFAULT_CHIP,
) -> None:
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("compressed scatter (scenario 2) is not emulated")
    if cache_mode == "PA_NZ":
        raise NotImplementedError("cache_mode='PA_NZ' (NZ caches) is not emulated; ND caches need cache_mode='Norm'")
    if cache_mode not in (None, "Norm"):
        raise NpuOpError(f"cache_mode must be 'Norm' or 'PA_NZ', got {cache_mode!r}")
    _contiguous(key=key, value=value, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)
    _check_write(key, value, key_cache, value_cache)
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (key.shape[0],):
        raise NpuOpError(f"slot_mapping must be int32/int64 [num_tokens={key.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    _scatter(key, value, key_cache, value_cache, slot_mapping, _chip)


def _bind(fn: Callable, chip: Chip, drop: tuple[str, ...] = ()) -> Callable:
    """``fn`` on ``chip`` with the public signature of that torch_npu build: ``_chip`` hidden, the
    keywords in ``drop`` absent (passing one is the TypeError an older build raises)."""
    sig = inspect.signature(fn)
    hidden = ("_chip", *drop)

    @functools.wraps(fn)
    def op(*args, **kwargs):
        for name in hidden:
            if name in kwargs:
                raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {name!r}")
        return fn(*args, _chip=chip, **kwargs)

    op.__signature__ = sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in hidden])
    return op


# -- torch_npu.npu: a synchronous single-device runtime --------------------------------------------


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False):
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait(self, stream: object = None) -> None:
        return None


class Stream:
    def __init__(self, device: object = None, priority: int = 0):
        self.device = device

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Event) -> None:
        return None

    def wait_stream(self, stream: Stream) -> None:
        return None

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event


def _make_npu_namespace(soc_version: int, device_count: int) -> types.ModuleType:
    npu = types.ModuleType("torch_npu.npu")
    default = Stream()

    @contextlib.contextmanager
    def stream(s: Stream | None) -> Iterator[None]:
        yield

    def mem_get_info(device: object = None) -> tuple[int, int]:
        # The emulated device's memory is this process's host memory: used = resident set size,
        # which moves at once with every (zero-filled) allocation and free, as device memory does.
        # (The host's free figure lags by seconds after large frees in a VM with free-page reporting.)
        # malloc_trim first: freed heap memory the allocator keeps resident would otherwise be reused
        # by the next allocation without moving the resident set.
        if _libc is not None:
            _libc.malloc_trim(0)
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * page
        return max(0, total - resident), total

    npu.Stream, npu.Event, npu.stream, npu.mem_get_info = Stream, Event, stream, mem_get_info
    npu.device_count = lambda: device_count
    npu.is_available = lambda: device_count > 0
    npu.set_device = lambda device: None
    npu.current_device = lambda: 0
    npu.current_stream = lambda device=None: default
    npu.synchronize = lambda device=None: None
    name = {"A2": "Ascend910B3", "A3": "Ascend910_9392", "310P": "Ascend310P3", "A5": "Ascend950PR"}.get(
        Chip(soc_version).family, "Ascend (unknown SoC)")
    npu.get_device_name = lambda device=None: f"{name} (emulated)"
    npu.get_soc_version = lambda: soc_version
    npu.manual_seed_all = lambda seed: torch.manual_seed(seed)
    return npu


try:
    import ctypes

    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: the resident set is read as is
    _libc = None


def _sibling(part: str) -> types.ModuleType:
    """``npu_emulator_<part>.py`` beside this file, loaded by path once under a unique name
    (sibling test dirs share basenames)."""
    name = f"hwkv_ascend_tests_npu_emulator_{part}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"npu_emulator_{part}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _dense_ops() -> types.ModuleType:
    return _sibling("dense")


def make_module(soc_version: int = 222, device_count: int = 1, version: str = "2.10.0+emulated",
                cann: str = "9.0.0") -> types.ModuleType:
    """A fresh ``torch_npu`` stand-in: ``soc_version`` 222 is an A2 (910B3), 252 an A3, 202 a 310P,
    260 an A5; ``version`` below 2.10 has no ``cache_mode`` on the KV write; ``cann`` is what
    ``torch_npu.npu.utils.get_cann_version()`` reports."""
    chip = Chip(soc_version, cann, version)
    mod = types.ModuleType("torch_npu")
    mod.__version__ = version
    mod.HWKV_EMULATED = True
    mod.npu = _make_npu_namespace(soc_version, device_count)
    mod.npu.utils = types.SimpleNamespace(get_cann_version=lambda module="CANN": cann)
    mod.npu_fused_infer_attention_score = _bind(npu_fused_infer_attention_score, chip)
    mod.npu_scatter_pa_kv_cache = _bind(npu_scatter_pa_kv_cache, chip,
                                        drop=() if chip.has_cache_mode else ("cache_mode",))
    mod._npu_paged_attention = _npu_paged_attention
    dense = _dense_ops()
    for name in dense.OPS:
        setattr(mod, name, getattr(dense, name))
    _register_hccl()
    _graph_runtime().install(mod, ("npu_fused_infer_attention_score", "npu_scatter_pa_kv_cache",
                                   "_npu_paged_attention", *dense.OPS))
    return mod


def _register_hccl() -> None:
    """torch_npu registers the ``hccl`` torch.distributed backend on import; emulated, its
    collectives run over gloo (CPU tensors), so the generic communicator runs unchanged."""
    import torch.distributed as dist

    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", lambda store, rank, size, timeout:
                                      dist.ProcessGroupGloo(store, rank, size, timeout), devices=["cpu"])


def _graph_runtime() -> types.ModuleType:
    return _sibling("graph")

"""The toy backend: the same contracts as the reference, implemented differently.

* KV layout SEPARATE_KV: per layer one K and one V tensor ``[num_blocks, block_size, H_kv, D]``.
* Attention is split-KV ("flash-decoding" style): each request's KV range is cut into splits of
  :data:`SPLIT_TOKENS` tokens, each split yields a partial output and its log-sum-exp, and the
  partials are merged exactly with ``out = sum_c exp(lse_c - lse) * out_c``.
* Metadata is converted into the backend's own form (host-side per-request tuples).
* ``copy_blocks`` merges consecutive block ids into one slice copy per run.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
from dataclasses import dataclass

import torch

from hwkv.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Backend,
    Capabilities,
    Device,
    KVCache,
    KVLayoutKind,
    group_concurrent_contiguous,
)

SPLIT_TOKENS = 24  # deliberately not a multiple of any block size: splits cross block boundaries


class ToyEvent:
    def record(self, stream: ToyStream | None = None) -> None:
        return None

    def query(self) -> bool:
        return True  # host work is complete when issued

    def synchronize(self) -> None:
        return None


class ToyStream:
    def synchronize(self) -> None:
        return None

    def wait_event(self, event: ToyEvent) -> None:
        return None

    def wait_stream(self, stream: ToyStream) -> None:
        return None


try:
    import ctypes

    _libc: ctypes.CDLL | None = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: the resident set is read as is
    _libc = None


class ToyDevice(Device):
    type = "cpu"
    dist_backend = "gloo"

    def description(self) -> str:
        return f"toy device on the host CPU ({platform.machine()}, {os.cpu_count()} cores)"

    def memory_info(self) -> tuple[int, int]:
        # The toy device's memory is this process's host memory: free = total - resident set, which
        # moves at once with every allocation and free (the host's free figure lags by seconds after
        # large frees in a VM). malloc_trim first, so freed heap memory kept resident is not counted.
        if _libc is not None:
            _libc.malloc_trim(0)
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * page
        return max(0, total - resident), total

    def new_stream(self) -> ToyStream:
        return ToyStream()

    def current_stream(self) -> ToyStream:
        return ToyStream()

    def stream_context(self, stream: ToyStream) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def new_event(self) -> ToyEvent:
        return ToyEvent()

    def synchronize(self) -> None:
        return None

    def copy_blocks(self, src: KVCache, dst: KVCache, pairs: list[tuple[int, int]], stream: object = None) -> None:
        if self.check_copy(src, dst, pairs) is None:
            return
        runs = group_concurrent_contiguous([s for s, _ in pairs], [d for _, d in pairs])
        for ts, td in zip(src.tensors, dst.tensors):
            for s, d, n in runs:
                chunk = ts[s : s + n]
                td[d : d + n].copy_(chunk)  # check_copy: within one cache, sources and destinations are disjoint


@dataclass
class ToyMetadata:
    reqs: list[tuple[int, int, int]]  # per request: (first query token, query length, seq length)
    block_tables: torch.Tensor
    block_size: int
    slot_mapping: torch.Tensor  # core's, for write_kv (the model reads it from any backend's metadata)


class ToyMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: AttentionMetadata) -> ToyMetadata:
        qsl, sl = common.query_start_loc_cpu.tolist(), common.seq_lens_cpu.tolist()
        reqs = [(qsl[i], qsl[i + 1] - qsl[i], sl[i]) for i in range(len(sl))]
        return ToyMetadata(reqs, common.block_tables.long(), common.block_size, common.slot_mapping)


def _partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [Hkv, G, Q, D] over one KV split ``k``/``v`` [S, Hkv, D].

    Returns the split's normalised output [Hkv, G, Q, D] and log-sum-exp [Hkv, G, Q] (-inf where a
    query row may see no key of this split; its output is then 0).
    """
    s = torch.einsum("hgqd,shd->hgqs", q, k) * scale
    s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.clamp_min(-1e30)[..., None])
    return torch.einsum("hgqs,shd->hgqd", p, v), lse


class ToyAttentionImpl(AttentionImpl):
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: tuple[torch.Tensor, torch.Tensor],
                 slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = layer_kv
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        n = slot_mapping.numel()
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key[:n][keep].to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value[:n][keep].to(v_cache.dtype))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                layer_kv: tuple[torch.Tensor, torch.Tensor], metadata: ToyMetadata) -> torch.Tensor:
        k_cache, v_cache = layer_kv
        bs, hkv, d = metadata.block_size, self.num_kv_heads, self.head_size
        g = self.num_heads // hkv
        out = torch.zeros_like(query)
        for r, (start, ql, sl) in enumerate(metadata.reqs):
            blocks = metadata.block_tables[r, : math.ceil(sl / bs)]
            k = k_cache[blocks].flatten(0, 1)[:sl].float()
            v = v_cache[blocks].flatten(0, 1)[:sl].float()
            q = query[start : start + ql].float().view(ql, hkv, g, d).permute(1, 2, 0, 3)
            q_pos = torch.arange(sl - ql, sl, device=query.device)
            parts = [
                _partial(q, k[a : a + SPLIT_TOKENS], v[a : a + SPLIT_TOKENS], q_pos,
                         torch.arange(a, min(a + SPLIT_TOKENS, sl), device=query.device), self.scale)
                for a in range(0, sl, SPLIT_TOKENS)
            ]
            lse = torch.logsumexp(torch.stack([lse_c for _, lse_c in parts]), 0)
            o = sum(o_c * torch.exp(lse_c - lse)[..., None] for o_c, lse_c in parts)
            out[start : start + ql] = o.permute(2, 0, 1, 3).reshape(ql, self.num_heads, d).to(out.dtype)
        return out


class ToyAttentionBackend(AttentionBackend):
    name = "toy-split-kv"
    kv_layout = KVLayoutKind.SEPARATE_KV

    def metadata_builder(self) -> ToyMetadataBuilder:
        return ToyMetadataBuilder()

    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> ToyAttentionImpl:
        return ToyAttentionImpl(num_heads, head_size, num_kv_heads, scale)


class ToyBackend(Backend):
    name = "toy"

    def __init__(self) -> None:
        self._caps = Capabilities(
            dtypes=(torch.float32, torch.bfloat16),
            head_sizes=(64, 128),
            block_size_multiple=16,
            max_block_size=128,
            default_block_size=16,
            kv_layouts=(KVLayoutKind.SEPARATE_KV,),
            transfer_reason="the toy backend ships no transfer engine",
            max_gqa_ratio=8,
        )
        self._device, self._attention = ToyDevice(), ToyAttentionBackend()

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return True, ""

"""Attention mutants: a plain per-request paged attention (the shape of a vendor kernel, correct as
written: :class:`VendorImpl`) with one step overridden by a realistic mistake."""

from __future__ import annotations

import math
from typing import Any

import torch

from conformance.mutants.base import mutant
from hwkv.interfaces import AttentionMetadata, AttentionMetadataBuilder
from hwkv.interfaces.kv_quant import is_quantized, v_token_view
from hwkv.reference import ReferenceAttentionImpl
from hwkv.reference.attention import split_kv

PROD = ("test_attention_production",)
SMALL = ("test_attention.py::test_attention[float32-bs16-hd64",)


class VendorImpl(ReferenceAttentionImpl):
    """Per request: gather its blocks, scores in float32, causal mask, softmax, P @ V."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any,
                metadata: Any) -> torch.Tensor:
        k_cache, v_cache = split_kv(layer_kv)
        if is_quantized(v_cache.dtype):  # fp8 V pages are stored [H_kv, D, block_size] (hwkv.interfaces.kv_quant)
            v_cache = v_token_view(v_cache)
        bs = k_cache.shape[1]
        q_all = self.read_query(query)
        out = torch.zeros(query.shape, dtype=query.dtype)
        qsl, sl = metadata.query_start_loc_cpu.tolist(), metadata.seq_lens_cpu.tolist()
        tables = self.block_tables(metadata)
        heads = torch.arange(self.num_heads) // (self.num_heads // self.num_kv_heads)
        for r in self.requests(len(sl)):
            q0, q1 = qsl[r], qsl[r + 1]
            ql, seq = q1 - q0, self.seq_len(sl[r], q1 - q0, metadata)
            if ql == 0:
                continue
            blocks = tables[r, : self.num_blocks(seq, bs)]
            first = self.first_key(seq, ql)
            k = self.gather(k_cache, blocks)[first:seq][:, heads]  # [S, H, D]
            v = self.gather(v_cache, blocks)[first:seq][:, heads]
            if is_quantized(k_cache.dtype):  # fp8 KV: dequantise with the head's K / V scale
                sc = self.scales_for(layer_kv)
                k, v = k.float() * sc[0][heads][:, None], v.float() * sc[1][heads][:, None]
            s = self.scores(q_all[q0:q1], k, query.dtype)  # [H, Q, S] float32, scaled
            if self.softcap is not None:
                s = self.cap(s)
            pos_q = seq - ql + torch.arange(ql)
            pos_k = first + torch.arange(k.shape[0])
            s = s.masked_fill(~self.mask(pos_q, pos_k), float("-inf"))
            if self.sinks is not None:  # one more logit per query head, with a zero value
                s = torch.cat([s, self.sink_logits(heads)[:, None, None].expand(-1, ql, 1)], -1)
                v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
            out[q0:q1] = self.combine(s, v, query.dtype).to(out.dtype)
        return self.finish(out)

    # -- the steps a mutant overrides ---------------------------------------------------------------
    def read_query(self, query: torch.Tensor) -> torch.Tensor:
        return query

    def block_tables(self, metadata: Any) -> torch.Tensor:
        return metadata.block_tables.long()

    def requests(self, n: int) -> range:
        return range(n)

    def seq_len(self, seq: int, ql: int, metadata: Any) -> int:
        return seq

    def num_blocks(self, seq: int, bs: int) -> int:
        return -(-seq // bs)

    def gather(self, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return cache[blocks].flatten(0, 1)

    def first_key(self, seq: int, ql: int) -> int:
        return 0

    def scores(self, q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.einsum("qhd,shd->hqs", q.float(), k.float()) * self.scale

    def mask(self, pos_q: torch.Tensor, pos_k: torch.Tensor) -> torch.Tensor:
        m = pos_k[None, :] <= pos_q[:, None]
        if self.window is not None:  # keys in (p - window, p]
            m &= pos_k[None, :] > pos_q[:, None] - self.window
        return m

    def cap(self, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(s / self.softcap) * self.softcap

    def sink_logits(self, heads: torch.Tensor) -> torch.Tensor:
        """``[H]`` float32: query head ``h``'s sink (``heads``: each query head's KV head)."""
        return self.sinks.float()

    def combine(self, s: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.einsum("hqs,shd->qhd", s.softmax(-1), v.float())

    def finish(self, out: torch.Tensor) -> torch.Tensor:
        return out


def _impl(name: str, **steps: Any) -> type[VendorImpl]:
    return type(f"VendorImpl_{name}", (VendorImpl,), steps)


def _split_combine(s: torch.Tensor, v: torch.Tensor, part: int, max_parts: int | None, merge: str) -> torch.Tensor:
    """Split-KV (flash-decoding): softmax per partition of ``part`` keys, then merge the partials."""
    outs, lses = [], []
    for i, a in enumerate(range(0, s.shape[-1], part)):
        if max_parts is not None and i >= max_parts:
            break  # BUG (partition table): keys past max_parts partitions are never visited
        sc = s[..., a : a + part]
        lse = torch.logsumexp(sc, -1)  # [H, Q]
        p = torch.exp(sc - lse.clamp_min(-1e30)[..., None])
        outs.append(torch.einsum("hqs,shd->hqd", p, v[a : a + part].float()))
        lses.append(lse)
    lse = torch.stack(lses)  # [P, H, Q]
    if merge == "count":  # BUG: partials averaged by key count, not by their softmax mass
        n = torch.tensor([min(part, s.shape[-1] - a) for a in range(0, s.shape[-1], part)][: len(outs)])
        w = (n / n.sum()).view(-1, 1, 1).expand_as(lse) * torch.isfinite(lse)
        w = w / w.sum(0, keepdim=True)
    else:
        w = torch.exp(lse - torch.logsumexp(lse, 0))
    return (w[..., None] * torch.stack(outs)).sum(0).permute(1, 0, 2)


class StaleBuilder(AttentionMetadataBuilder):
    """BUG: caches built metadata by batch size (for graph replay) and returns it for any later step
    with as many requests — the new seq lens, query starts and block tables never reach the kernel."""

    def __init__(self) -> None:
        self._cache: dict[int, AttentionMetadata] = {}

    def build(self, common: AttentionMetadata) -> AttentionMetadata:
        return self._cache.setdefault(common.num_reqs, common)


class StaleTables(VendorImpl):
    """BUG: converts the block table once per shape and reuses it (a persistent device buffer that is
    only refreshed when the batch shape changes)."""

    def block_tables(self, metadata: Any) -> torch.Tensor:
        cache = self.__dict__.setdefault("_tables", {})
        return cache.setdefault(tuple(metadata.block_tables.shape), metadata.block_tables.long())


def _accumulate_in_dtype(s: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """BUG: P @ V accumulated tile by tile (64 keys) in the input dtype, not in float32."""
    p = s.softmax(-1)
    acc = torch.zeros(p.shape[1], p.shape[0], v.shape[-1], dtype=dtype)
    for a in range(0, p.shape[-1], 64):
        acc = (acc.float() + torch.einsum("hqs,shd->qhd", p[..., a : a + 64], v[a : a + 64].float())).to(dtype)
    return acc.float()


def _exp_in_dtype(s: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """BUG: softmax without subtracting the row max, exponentials in the input dtype (fp16 overflows
    above a logit of 11)."""
    e = torch.exp(s.to(dtype)).float()
    return torch.einsum("hqs,shd->qhd", e / e.sum(-1, keepdim=True), v.float())


def _contiguous_view(t: torch.Tensor) -> torch.Tensor:
    """BUG: the kernel indexes q with contiguous strides, whatever the tensor's strides are."""
    strides = [math.prod(t.shape[i + 1 :]) for i in range(t.dim())]
    return torch.as_strided(t, t.shape, strides, t.storage_offset())


mutant("attn-ignores-scale", "attention", "ignores the scale argument: always 1/sqrt(head_size)", PROD,
       impl=_impl("scale", scores=lambda self, q, k, dt: torch.einsum("qhd,shd->hqs", q.float(), k.float())
                  * self.head_size**-0.5))
mutant("attn-scores-in-dtype", "attention", "Q @ K^T computed and scaled in the input dtype (half-precision scores)",
       PROD, impl=_impl("sdtype", scores=lambda self, q, k, dt: (torch.einsum(
           "qhd,shd->hqs", q.to(dt), k.to(dt)) * self.scale).float()))
mutant("attn-scores-fp16", "attention", "scores rounded to float16 before the softmax, whatever the dtype", PROD,
       impl=_impl("sfp16", scores=lambda self, q, k, dt: VendorImpl.scores(self, q, k, dt).half().float()))
mutant("attn-pv-accumulates-in-dtype", "attention", "P @ V accumulated across 64-key tiles in the input dtype",
       PROD, impl=_impl("pvacc", combine=lambda self, s, v, dt: _accumulate_in_dtype(s, v, dt)))
mutant("attn-exp-without-max", "attention", "softmax without subtracting the max, exponentials in the input dtype",
       PROD, impl=_impl("expmax", combine=lambda self, s, v, dt: _exp_in_dtype(s, v, dt)))
mutant("attn-splitkv-merge-by-count", "attention",
       "split-KV partials (512 keys) merged by key count instead of by log-sum-exp", PROD,
       impl=_impl("merge", combine=lambda self, s, v, dt: _split_combine(s, v, 512, None, "count")))
mutant("attn-partition-table-8", "attention",
       "split-KV with a fixed table of 8 partitions of 512 keys: keys past 4096 never visited", PROD,
       impl=_impl("parts", combine=lambda self, s, v, dt: _split_combine(s, v, 512, 8, "lse")))
mutant("attn-block-table-32", "attention", "a fixed 32-entry block table per request: blocks past 32 dropped", PROD,
       impl=_impl("bt32", num_blocks=lambda self, seq, bs: min(-(-seq // bs), 32)))
mutant("attn-window-4096", "attention", "a 4096-token sliding window left on (keys older than 4096 dropped)", PROD,
       impl=_impl("window", mask=lambda self, pq, pk: (pk[None] <= pq[:, None]) & (pk[None] > pq[:, None] - 4096)))
mutant("attn-batch-limit-8", "attention", "a fixed batch of 8 requests: requests past the 8th get zeros", PROD,
       impl=_impl("batch8", requests=lambda self, n: range(min(n, 8))))
mutant("attn-query-contiguous", "attention", "q read with contiguous strides (a fused qkv view is strided)", PROD,
       impl=_impl("qstride", read_query=lambda self, q: _contiguous_view(q)))
mutant("attn-tail-block-dropped", "attention", "blocks per request seq_len // block_size: the partial last block is "
       "never read", SMALL, impl=_impl("tail", num_blocks=lambda self, seq, bs: seq // bs))
mutant("attn-decode-last-tile-skewed", "attention", "a software-pipelined decode loop masks each 64-key tile with the "
       "next tile's mask: a decode's partial last tile is never read (a request under 64 keys reads nothing)", SMALL,
       impl=_impl("skew", seq_len=lambda self, seq, ql, md: seq // 64 * 64 if ql == 1 else seq))
mutant("attn-decode-max-seq", "attention", "decodes use the batch's max_seq_len for every request (padded kernel)",
       SMALL, impl=_impl("maxseq", seq_len=lambda self, seq, ql, md: md.max_seq_len if ql == 1 else seq))
mutant("attn-stale-metadata", "attention", "metadata builder caches its output by batch shape (stale across steps)",
       PROD, builder=StaleBuilder, impl=VendorImpl)
mutant("attn-stale-block-table", "attention", "block table converted once per shape and reused across steps", PROD,
       impl=StaleTables)
mutant("attn-prefix-ignored", "attention", "a chunk on a cached prefix attends to the chunk only (cu_seqlens_k = "
       "cu_seqlens_q)", ("test_attention.py::test_attention[float32-bs16-hd64-prefix",),
       impl=_impl("prefix", first_key=lambda self, seq, ql: seq - ql if ql > 1 else 0))
mutant("attn-output-via-bf16", "attention", "output written through a bfloat16 intermediate", PROD,
       impl=_impl("outbf16", finish=lambda self, out: out.to(torch.bfloat16).to(out.dtype)))
mutant("attn-block-size-16", "attention", "block size hard-coded to 16 when gathering the cache", SMALL + PROD,
       impl=_impl("bs16", gather=lambda self, c, b: c.reshape(-1, 16, *c.shape[2:])[b].flatten(0, 1)))


# -- suite 3.0: sizes past 32k keys, 2,048 table entries, 2^15 block ids ----------------------------
LONG = ("test_long_context.py::test_attention_long_context[float32",)
_NARROW = type("Attn_int16", (VendorImpl,), {
    "block_tables": lambda self, md: md.block_tables.to(torch.int16).long()})  # BUG: ids past 2^15 wrap
_TABLE_2048 = type("Attn_t2048", (VendorImpl,), {
    "num_blocks": lambda self, seq, bs: min(-(-seq // bs), 2048)})  # BUG: a fixed 2,048-entry table
_KEYS_32K = type("Attn_32k", (VendorImpl,), {
    "first_key": lambda self, seq, ql: max(0, seq - 32768)})  # BUG: 64 partitions of 512 keys: older dropped
mutant("attn-block-id-int16", "attention", "block tables narrowed to int16 (ids past 2^15 wrap)", LONG, impl=_NARROW)
mutant("attn-block-id-uint16", "attention", "block tables narrowed to 16 unsigned bits (ids past 2^16 wrap)", LONG,
       impl=type("Attn_uint16", (VendorImpl,), {"block_tables": lambda self, md: md.block_tables.long() & 0xFFFF}))
mutant("attn-block-table-2048", "attention", "a fixed 2,048-entry block table per request", LONG, impl=_TABLE_2048)
mutant("attn-partitions-32k", "attention", "split-KV with at most 64 partitions of 512 keys: keys older than 32k "
       "never visited", LONG, impl=_KEYS_32K)


# -- per-layer attention parameters (conformance/test_attention_features.py) -----------------------
FEAT = ("test_attention_features.py::test_attention_features[float32-bs16-",)


def _window_mask(self: VendorImpl, pq: torch.Tensor, pk: torch.Tensor, extra: int = 0, decode: bool = True):
    m = pk[None] <= pq[:, None]
    if self.window is not None and (decode or len(pq) > 1):
        m &= pk[None] > pq[:, None] - self.window - extra
    return m


mutant("attn-window-off-by-one", "attention", "sliding window keeps window + 1 keys (p - window included)", FEAT,
       impl=_impl("winob1", mask=lambda self, pq, pk: _window_mask(self, pq, pk, extra=1)))
mutant("attn-window-prefill-only", "attention", "the window is applied to prefill queries only: decodes read the "
       "whole context", FEAT, impl=_impl("windec", mask=lambda self, pq, pk: _window_mask(self, pq, pk, decode=False)))
mutant("attn-softcap-clamp", "attention", "soft-cap as a clamp to [-cap, cap] instead of cap * tanh(s / cap)", FEAT,
       impl=_impl("capclamp", cap=lambda self, s: s.clamp(-self.softcap, self.softcap)))
mutant("attn-sinks-per-kv-head", "attention", "sinks indexed by KV head instead of query head", FEAT,
       impl=_impl("sinkkv", sink_logits=lambda self, heads: self.sinks.float()[heads]))
mutant("attn-sinks-scaled", "attention", "sink logits multiplied by the softmax scale like a score", FEAT,
       impl=_impl("sinkscale", sink_logits=lambda self, heads: self.sinks.float() * self.scale))


# -- spec-decode verify queries (conformance/test_spec_decode.py, test_long_context.py) ------------
VERIFY = ("test_spec_decode.py::test_attention_verify_queries[float32-",)


def _verify_unmasked(self: VendorImpl, pq: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
    """BUG: a query of 2..8 tokens (a k+1 verify) takes the multi-token decode path, which masks no row:
    every draft position also sees the drafts after it."""
    if 2 <= len(pq) <= 8:
        return (pk[None] <= pq[-1]).expand(len(pq), -1)
    return VendorImpl.mask(self, pq, pk)


mutant("attn-verify-not-causal", "attention", "a 2..8-token query (spec verify) runs the multi-token decode path "
       "without the causal mask among its rows", VERIFY, impl=_impl("verifymask", mask=_verify_unmasked))

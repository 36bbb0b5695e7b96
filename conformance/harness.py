"""Kernel-level scenario building, driven only through the public interfaces.

Both the backend under test and the reference get the same inputs: each writes the same K/V through
its *own* ``write_kv`` (same slot mapping) into a cache of its *own* declared layout, then runs its
own ``forward``; outputs are compared. Per-token K/V are read back through the layout definitions
(:func:`read_tokens`), never through a backend's internals.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from hwkv.interfaces import (
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Backend,
    KVCache,
    KVCacheSpec,
)
from hwkv.interfaces.kv_quant import is_quantized, v_token_view
from hwkv.testing.paged import random_block_tables

NUM_LAYERS = 2
LAYER = 1  # the layer under test; layer 0 holds decoy K/V at the same slots
STATES = ("prefill", "prefix", "decode", "mixed")
# GQA ratio label -> (num_heads, num_kv_heads)
GQA = {"1": (4, 4), "4": (8, 2), "8": (16, 2), "mqa": (8, 1)}


def generator(seed: int, nodeid: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed ^ zlib.crc32(nodeid.encode()))


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Seeded CPU normal values rounded to ``dtype`` (so reference and backend see identical inputs)."""
    return torch.randn(*shape, generator=gen).to(dtype)


def scenario(state: str, bs: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """``(cached_context_len, query_len)`` per request, ragged and scaled to span several blocks."""
    # Query lengths are capped (cost grows with tokens x keys); every request that can still spans
    # several blocks, and chunks cross block boundaries.
    if state == "prefill":
        reqs = [(0, bs + 3), (0, 7), (0, min(max(2, 2 * bs - 1), 40))]
    elif state == "prefix":  # block-aligned and unaligned prefixes, chunks shorter/longer than a block
        reqs = [(bs, 5), (2 * bs - 5 if bs > 5 else 2 * bs + 3, min(bs + 2, 21)), (3, 2)]
    elif state == "decode":
        reqs = [(2 * bs, 1), (5, 1), (3 * bs + 1, 1), (max(bs - 1, 1), 1), (0, 1)]
    elif state == "mixed":
        reqs = [(bs + 1, 1), (0, min(bs + 2, 40)), (2 * bs + 3, 4), (7, 1), (0, 3)]
    elif state == "long_decode":  # not in STATES: ~18k keys, the split decodes a GPU runs at long context
        reqs = [(9000, 1), (6100, 1), (2100, 1), (700, 1)]
    else:
        raise ValueError(f"state {state!r} not in {STATES}")
    order = torch.randperm(len(reqs), generator=gen).tolist()
    return [reqs[i] for i in order]


def new_cache(backend: Backend, spec: KVCacheSpec, fill: torch.Generator | None = None) -> KVCache:
    """The backend's own layout on its device; ``fill`` writes garbage everywhere (catches reads of
    unwritten slots) through the public tensors."""
    kv = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout)
    if fill is not None:
        for t in kv.tensors:
            t.copy_(garbage(t.numel(), fill).view(t.shape).to(t.dtype))
    return kv


GARBAGE_PERIOD = 65521  # prime: the pattern never lines up with blocks, heads or head sizes


def garbage(n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` finite, large-ish values: a seeded random pattern repeated (cheap for big caches)."""
    pat = torch.randn(min(n, GARBAGE_PERIOD), generator=gen).mul_(3)
    return pat.repeat(-(-n // pat.numel()))[:n]


def read_tokens(kv: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` of every slot of ``layer`` as CPU ``[num_blocks * block_size, H_kv, D]``."""
    s = kv.spec
    lk = kv.layer(layer)
    k, v = lk if isinstance(lk, tuple) else (lk[:, 0], lk[:, 1])
    if is_quantized(v.dtype):  # fp8 V pages are stored [H_kv, D, block_size] (hwkv.interfaces.kv_quant)
        v = v_token_view(v)
    n = s.num_blocks * s.block_size
    return k.reshape(n, s.num_kv_heads, s.head_size).cpu(), v.reshape(n, s.num_kv_heads, s.head_size).cpu()


def slots_for(tables: list[list[int]], positions: list[range], bs: int) -> torch.Tensor:
    out = [tables[r][p // bs] * bs + p % bs for r, rng in enumerate(positions) for p in rng]
    return torch.tensor(out, dtype=torch.long)


def production_scenario(bs: int) -> list[tuple[int, int]]:
    """A production-size mixed batch at block size ``bs``: the longest requests span >= 33 blocks and
    > 4096 tokens (past fixed-size block tables, partition tables and 4096-token windows), decodes of
    very unequal lengths beside a 64-token chunk on a long prefix and short fresh prefills; 12
    requests (past a fixed batch of 8)."""
    n = max(33 * bs + 7, 4500)
    return [(n - 64, 64), (n - 1, 1), (0, 1), (n // 2 + 3, 1), (17, 1), (3, 1), (3 * bs + 5, 1), (1000, 1),
            (2 * n // 3, 1), (0, 37), (5, 9), (n // 4, 1)]


@dataclass
class AttentionCase:
    reqs: list[tuple[int, int]]
    tables: list[list[int]]
    num_blocks: int
    bs: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    q: torch.Tensor  # [T, H, D]   (float32 values exactly representable in the case dtype)
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    k_ctx: torch.Tensor  # [C, Hkv, D] cached prefixes of all requests, concatenated
    v_ctx: torch.Tensor
    decoy: torch.Tensor | None  # [C + T, Hkv, D] written to layer 0 at the same slots (None: none)
    fill_seed: int | None  # garbage fill of the cache (None: the zero-filled cache as allocated)
    scale: float
    strided: bool = False  # q/k/v passed as views of one fused qkv tensor (what models pass)
    # a second step through the same impl and builder: every request decodes one more token, the
    # batch in another order (stale metadata or block tables cached across steps show)
    order2: list[int] | None = None
    q2: torch.Tensor | None = None  # [R, H, D] in order2's order
    k2: torch.Tensor | None = None
    v2: torch.Tensor | None = None

    def spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec(NUM_LAYERS, self.num_blocks, self.bs, self.num_kv_heads, self.head_size, dtype)


def make_case(state: str, bs: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
              gen: torch.Generator) -> AttentionCase:
    """A case of ``state`` (:data:`STATES`, unit-normal inputs, the default scale) or ``"production"``:
    :func:`production_scenario`, logits of realistic magnitude (std ~4.5: q ~ N(0, 4^2), k ~ N(0, 1.5^2),
    a non-default scale), strided q/k/v and a second, reordered decode step."""
    prod = state == "production"
    reqs = production_scenario(bs) if prod else scenario(state, bs, gen)
    tables, nb = random_block_tables([c + q + prod for c, q in reqs], bs, gen)
    t, c, r = sum(q for _, q in reqs), sum(c for c, _ in reqs), len(reqs)
    qm, km = (4.0, 1.5) if prod else (1.0, 1.0)
    rnd = lambda n, h, m=1.0: (randn(gen, n, h, head_size) * m).to(dtype).float()
    case = AttentionCase(
        reqs, tables, nb, bs, num_heads, num_kv_heads, head_size,
        q=rnd(t, num_heads, qm), k_new=rnd(t, num_kv_heads, km), v_new=rnd(t, num_kv_heads),
        k_ctx=rnd(c, num_kv_heads, km), v_ctx=rnd(c, num_kv_heads), decoy=rnd(c + t, num_kv_heads),
        fill_seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen)),
        scale=0.75 / math.sqrt(head_size) if prod else 1.0 / math.sqrt(head_size), strided=prod,
    )
    if prod:
        case.order2 = torch.randperm(r, generator=gen).tolist()
        case.q2, case.k2, case.v2 = rnd(r, num_heads, qm), rnd(r, num_kv_heads, km), rnd(r, num_kv_heads)
    return case


def fused_views(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` as the model passes them: views of one ``[T, (H + 2 H_kv) D]`` projection output
    (row stride ``(H + 2 H_kv) D``, not contiguous)."""
    t = q.shape[0]
    fused = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    qs, ks, vs = fused.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    return qs.view(q.shape), ks.view(k.shape), vs.view(v.shape)


def run_attention(backend: Backend, case: AttentionCase, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                  kv_scales: torch.Tensor | None = None, features: dict[str, Any] | None = None) -> torch.Tensor:
    """``case`` on ``backend`` in ``dtype``; output (both steps, concatenated) as float32 on the CPU.
    ``kv_dtype``: the cache's storage dtype (fp8: quantised with ``kv_scales`` ``[2, H_kv]``).
    ``features``: per-layer attention parameters set on the impl (``window``, ``softcap``, ``sinks``)."""
    dev = backend.device.torch_device
    spec = case.spec(kv_dtype or dtype)
    fill = None if case.fill_seed is None else torch.Generator().manual_seed(case.fill_seed)
    kv = new_cache(backend, spec, fill=fill)
    impl = backend.attention.make_impl(case.num_heads, case.head_size, case.num_kv_heads, case.scale)
    if kv_scales is not None:
        impl.kv_scales = kv_scales.to(dev)
    for name, value in (features or {}).items():
        setattr(impl, name, value.to(dev) if isinstance(value, torch.Tensor) else value)
    builder = backend.attention.metadata_builder()
    on = lambda x: x.to(device=dev, dtype=dtype)
    qkv = lambda q, k, v: fused_views(on(q), on(k), on(v)) if case.strided else (on(q), on(k), on(v))
    ctx_slots = slots_for(case.tables, [range(c) for c, _ in case.reqs], case.bs)
    common = AttentionMetadata.build(
        [q for _, q in case.reqs], [c + q for c, q in case.reqs], case.tables, case.bs, device=dev
    )
    all_slots = torch.cat([ctx_slots, common.slot_mapping.cpu()])
    # Decoys in another layer at the same slots: a backend reading the wrong layer fails.
    if case.decoy is not None:
        impl.write_kv(on(case.decoy), on(case.decoy.flip(0)), kv.layer(0), all_slots.to(dev))
    if ctx_slots.numel():  # the cached prefix, as earlier steps would have written it
        _, k, v = qkv(torch.zeros(ctx_slots.numel(), case.num_heads, case.head_size), case.k_ctx, case.v_ctx)
        impl.write_kv(k, v, kv.layer(LAYER), ctx_slots.to(dev))
    outs = [_step(backend, impl, builder, kv, common, *qkv(case.q, case.k_new, case.v_new), dtype)]
    if case.order2 is not None:
        o = case.order2
        reqs = [case.reqs[i] for i in o]
        common2 = AttentionMetadata.build([1] * len(o), [c + q + 1 for c, q in reqs], [case.tables[i] for i in o],
                                          case.bs, device=dev)
        outs.append(_step(backend, impl, builder, kv, common2, *qkv(case.q2, case.k2, case.v2), dtype))
    return torch.cat(outs)


def _step(backend: Backend, impl: AttentionImpl, builder: AttentionMetadataBuilder, kv: KVCache,
          common: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          dtype: torch.dtype) -> torch.Tensor:
    md = builder.build(common)
    impl.write_kv(k, v, kv.layer(LAYER), common.slot_mapping)
    out = impl.forward(q, k, v, kv.layer(LAYER), md)
    backend.device.synchronize()
    exp = (q.shape[0], q.shape[1], q.shape[2])
    assert tuple(out.shape) == exp, f"forward returned shape {tuple(out.shape)}, expected {exp}"
    assert out.dtype == dtype, f"forward returned dtype {out.dtype}, expected the query's {dtype}"
    return out.float().cpu()

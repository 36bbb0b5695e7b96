"""KV write: ``write_kv`` scatters each token to its slot, skips slot -1, touches nothing else."""

from __future__ import annotations

import pytest
import torch

from conformance.harness import LAYER, NUM_LAYERS, fused_views, new_cache, randn, read_tokens
from conformance.report import not_supported
from hwkv.interfaces import KVCacheSpec

pytestmark = pytest.mark.capability("kv_write")
NUM_KV_HEADS = 2


def _write(backend, spec, k, v, slots, fill_k, fill_v):
    """Pre-fill every slot of every layer with known values via write_kv, then write ``k``/``v``."""
    dev = backend.device.torch_device
    kv = new_cache(backend, spec)
    impl = backend.attention.make_impl(NUM_KV_HEADS, spec.head_size, NUM_KV_HEADS, spec.head_size**-0.5)
    every = torch.arange(spec.num_blocks * spec.block_size, device=dev)
    for layer in range(NUM_LAYERS):
        impl.write_kv(fill_k[layer].to(dev), fill_v[layer].to(dev), kv.layer(layer), every)
    if k.device != dev:  # keep strided views strided on the device
        _, k, v = fused_views(torch.zeros(k.shape[0], 2 * NUM_KV_HEADS, k.shape[2], dtype=k.dtype, device=dev),
                               k.to(dev), v.to(dev))
    impl.write_kv(k, v, kv.layer(LAYER), slots.to(dev))
    backend.device.synchronize()
    return [read_tokens(kv, layer) for layer in range(NUM_LAYERS)]


def minus_one_positions(n: int) -> list[int]:
    """Token indices padded with -1 wherever a kernel's tiling could mishandle them: the first and
    the last token, a run of 17 (crosses a 16-token tile), every other token of a stretch, a run of
    16 aligned to a 16-token tile and a lone one just past it."""
    return sorted({0, n - 1, *range(100, 117), *range(200, 232, 2), *range(256, 272), 273})


@pytest.mark.parametrize("pattern", ["scatter", "with_minus_one", "all_minus_one", "minus_one_positions",
                                     "production"])
def test_write_kv(backend, reference, check, gen, dtype, block_size, head_size, pattern):
    """``production``: 4500 tokens over >= 36 blocks (past fixed-size chunks and token limits), some
    padded with -1, K/V as strided views of a fused qkv output (``with_minus_one`` is strided too)."""
    prod = pattern in ("production", "minus_one_positions")
    blocks = max(36, -(-5000 // block_size)) if prod else 5
    spec = KVCacheSpec(NUM_LAYERS, blocks, block_size, NUM_KV_HEADS, head_size, dtype)
    check.capability = f"kv_write/{pattern}"
    reasons = backend.capabilities.validate(spec, num_heads=NUM_KV_HEADS)
    if reasons:
        not_supported(reasons)
    n_slots = spec.num_blocks * block_size
    n = min(n_slots - 1, (4500 if pattern == "production" else 300) if prod else 2 * block_size + 3)
    slots = torch.randperm(n_slots, generator=gen)[:n]  # distinct, out of order, across blocks
    if pattern in ("with_minus_one", "production"):
        slots[torch.randperm(n, generator=gen)[: max(1, n // (50 if prod else 3))]] = -1
    elif pattern == "all_minus_one":
        slots[:] = -1
    elif pattern == "minus_one_positions":
        slots[minus_one_positions(n)] = -1
    shape = (spec.num_kv_heads, head_size)
    # ``scatter``: K/V carry 3 rows more than there are slots (a padded batch); the contract ignores
    # them (a kernel sized from K's rows instead of slot_mapping's reads slots past its end)
    rows = n + 3 if pattern == "scatter" else n
    k, v = randn(gen, rows, *shape, dtype=dtype), randn(gen, rows, *shape, dtype=dtype)
    if pattern in ("with_minus_one", "production"):
        _, k, v = fused_views(torch.zeros(n, 2 * NUM_KV_HEADS, head_size, dtype=dtype), k, v)
    fill = [[randn(gen, n_slots, *shape, dtype=dtype) for _ in range(NUM_LAYERS)] for _ in range(2)]

    got = _write(backend, spec, k, v, slots, *fill)
    ref = _write(reference, spec, k, v, slots, *fill)
    # The definition, independent of both backends: slot s holds its token, every other slot its fill.
    keep = slots >= 0
    for layer in range(NUM_LAYERS):
        want_k, want_v = fill[0][layer].clone(), fill[1][layer].clone()
        if layer == LAYER:
            want_k[slots[keep]], want_v[slots[keep]] = k[:n][keep], v[:n][keep]
        for i, (name, want) in enumerate((("K", want_k), ("V", want_v))):
            check.exact(ref[layer][i], want, "kv_write", f"reference layer {layer} {name}")
            check.exact(got[layer][i], ref[layer][i], "kv_write", f"layer {layer} {name} per slot")

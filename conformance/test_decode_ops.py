"""Decode ops (optional): a backend's fused small-batch dense ops against the torch reference ops
(:class:`hwkv.model.decode_ops.TorchDecodeOps`) run in the same dtype on the reference backend —
their contract is to compute those ops, rounding where they round. ``qkv`` must also leave the KV
cache exactly as the reference's ``write_kv`` would: the written slots within tolerance, every other
slot (and every other layer) untouched."""

from __future__ import annotations

import pytest
import torch

from conformance.harness import LAYER, NUM_LAYERS, new_cache, randn, read_tokens
from conformance.report import not_supported
from hwkv.interfaces import KVCacheSpec
from hwkv.model.decode_ops import TorchDecodeOps

pytestmark = pytest.mark.capability("decode_ops")
OPS = ("qkv", "linear", "norm_linear", "silu_linear", "norm_logits")
HEADS, KV_HEADS, HIDDEN, BLOCK, BLOCKS = 4, 2, 96, 16, 4  # hidden not a power of two


def _inputs(gen: torch.Generator, op: str, tokens: int, head_size: int, dtype: torch.dtype) -> dict:
    n = (HEADS + 2 * KV_HEADS) * head_size if op == "qkv" else 40
    k_in = 2 * HIDDEN if op == "silu_linear" else HIDDEN
    ang = torch.arange(64)[:, None] * (1.0 / 10000 ** (torch.arange(0, head_size, 2) / head_size))[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return dict(
        x=randn(gen, tokens, k_in, dtype=dtype), w=(randn(gen, n, HIDDEN) / HIDDEN**0.5).to(dtype),
        b=randn(gen, n, dtype=dtype), res=randn(gen, tokens, n, dtype=dtype),
        nw=(1 + 0.2 * randn(gen, HIDDEN)).to(dtype), cos=ang.cos().to(dtype), sin=ang.sin().to(dtype),
        pos=torch.randperm(64, generator=gen)[:tokens],
        # distinct slots across blocks, one of them -1 (padding) when there are several tokens
        slots=torch.cat([torch.tensor([-1] if tokens > 1 else []), torch.randperm(BLOCKS * BLOCK, generator=gen)
                         [: tokens - (tokens > 1)]]).long(),
    )


def _run(backend, ops, op: str, t: dict, head_size: int, dtype: torch.dtype):
    dev = backend.device.torch_device
    d = {k: v.to(dev) for k, v in t.items()}
    if op == "qkv":
        spec = KVCacheSpec(NUM_LAYERS, BLOCKS, BLOCK, KV_HEADS, head_size, dtype)
        kv = new_cache(backend, spec, fill=torch.Generator().manual_seed(7))
        impl = backend.attention.make_impl(HEADS, head_size, KV_HEADS, head_size**-0.5)
        out = ops.qkv(d["x"], d["nw"], 1e-5, d["w"], d["b"], d["cos"], d["sin"], d["pos"], impl, kv.layer(LAYER),
                      d["slots"], HEADS, KV_HEADS, head_size)
        backend.device.synchronize()
        return out.cpu(), [read_tokens(kv, layer) for layer in range(NUM_LAYERS)]
    if op == "linear":
        out = ops.linear(d["x"], d["w"], d["b"], d["res"])
    elif op == "norm_linear":
        out = ops.norm_linear(d["x"], d["nw"], 1e-5, d["w"], d["b"])
    elif op == "norm_logits":  # the LM head: float32 logits, whether written so or cast after
        out = ops.norm_logits(d["x"], d["nw"], 1e-5, d["w"])
        if out.dtype != torch.float32:
            raise AssertionError(f"norm_logits returned {out.dtype}; the contract is float32 logits")
    else:
        out = ops.silu_linear(d["x"], d["w"], d["b"], d["res"])
    backend.device.synchronize()
    return out.cpu(), None


@pytest.mark.parametrize("tokens", [1, 5, 8])
@pytest.mark.parametrize("op", OPS)
def test_decode_op(backend, reference, check, gen, dtype, head_size, op, tokens):
    check.capability = f"decode_ops/{op}"
    ops = backend.decode_ops()
    if ops is None:
        not_supported("the backend offers no DecodeOps (optional: Backend.decode_ops() returns None)")
    reasons = ops.validate(HEADS, KV_HEADS, head_size, dtype, dtype)
    if op == "qkv":
        spec = KVCacheSpec(NUM_LAYERS, BLOCKS, BLOCK, KV_HEADS, head_size, dtype)
        reasons += backend.capabilities.validate(spec, num_heads=HEADS)
    if tokens > ops.max_tokens:
        reasons.append(f"{tokens} tokens > max_tokens {ops.max_tokens}")
    if reasons:
        not_supported(reasons)
    t = _inputs(gen, op, tokens, head_size, dtype)
    got, kv_got = _run(backend, ops, op, t, head_size, dtype)
    want, kv_want = _run(reference, TorchDecodeOps(), op, t, head_size, dtype)
    check.close(got, want, dtype, "decode_ops", f"{op} output [{tokens}, N]", same_dtype_reference=True)
    if kv_got is None:
        return
    written = t["slots"][t["slots"] >= 0]
    kept = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    kept[written] = False
    for layer in range(NUM_LAYERS):
        for i, name in enumerate("KV"):
            g, w = kv_got[layer][i], kv_want[layer][i]
            if layer == LAYER:
                check.close(g[written], w[written], dtype, "decode_ops", f"{name} written by qkv",
                            same_dtype_reference=True)
            check.exact(g[kept if layer == LAYER else slice(None)], w[kept if layer == LAYER else slice(None)],
                        "kv_write", f"layer {layer} {name}: slots qkv must not touch")


@pytest.mark.parametrize("vocab", [1000, 50257])
def test_decode_argmax(backend, check, gen, vocab):
    """The optional greedy argmax (``DecodeOps.argmax``): exactly torch's index on float32 logits - the first of
    equal maxima within a row and across its parts, NaN as the maximum (its first), rows of -inf, -0.0 equal to 0.0."""
    check.capability = "decode_ops/argmax"
    ops = backend.decode_ops()
    if ops is None:
        not_supported("the backend offers no DecodeOps (optional: Backend.decode_ops() returns None)")
    x = randn(gen, 6, vocab)
    x[1, 3] = x[1, vocab - 2] = x[1].max() + 1
    x[2] = x[2].round()
    x[3] = float("-inf")
    x[4, 700] = x[4, 900] = float("nan")
    x[5] = -1.0
    x[5, 600], x[5, 40] = 0.0, -0.0
    got = ops.argmax(x.to(backend.device.torch_device))
    if got is None:
        not_supported("DecodeOps.argmax is not offered (optional: the sampler's own argmax runs)")
    backend.device.synchronize()
    check.exact(got, x.argmax(-1), "decode_ops", f"argmax of [6, {vocab}] float32 logits")

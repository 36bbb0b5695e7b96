"""Elementwise ops (optional): a backend's hand-written RMSNorm (+ residual add), neox RoPE and SiLU·mul
(``Backend.elementwise_ops()``, contract :mod:`hwkv.interfaces.elementwise_ops`) against the model's own
functions (``hwkv.model.layers.rms_norm`` / ``add_rms_norm`` / ``silu_mul``, ``hwkv.model.rope.apply_rope``)
run in the same dtype on the reference backend. The engine takes these ops before its compiled functions in
every forward of many tokens, so a wrong one changes every token.

Inputs are the ones kernels get wrong: widths that are not powers of two (96, 4099), a row-strided
hidden state and residual (views wider than the row), RoPE q/k as views of the fused qkv output (the row
stride of the whole qkv row), positions past 2^15 and 2^16 (index narrowing) in a random order, odd head
counts, a zero row (only ``eps`` keeps it finite), a tiny row (``eps`` dominates) and a row of massive
activations (|x| ~ 10^3: x^2 overflows float16 unless the sum of squares runs in float32).
Every call must also leave its inputs untouched and return new tensors (vLLM's own kernels work in place:
a port that keeps that writes over the residual or q/k the model reads again), and all ops must replay
correctly from a captured graph after their inputs changed in place (no host synchronisation).
An op may return ``None`` for an input it does not take (NOT_SUPPORTED here): the model then runs its
compiled function.
"""

from __future__ import annotations

import pytest
import torch

from conformance.harness import randn
from conformance.report import not_supported
from hwkv.model.layers import add_rms_norm, rms_norm, silu_mul
from hwkv.model.rope import apply_rope

pytestmark = pytest.mark.capability("elementwise")
NORM_SIZES = [(1, 64), (7, 96), (5, 4099)]  # (rows, width)
ROPE_HEADS = [(4, 2), (3, 1)]  # (heads, kv heads): GQA and an odd head count
MAX_POS = 65_573  # positions beyond 2^15 and 2^16
EPS = 1e-5  # 1e-6 at the widest rows: an ignored eps argument shows in the coverage table as one value


def _ops(backend):
    ops = backend.elementwise_ops()
    if ops is None:
        not_supported("the backend offers no ElementwiseOps (optional: Backend.elementwise_ops() returns None)")
    return ops


def _hidden(gen: torch.Generator, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``[rows, n]`` values with the rows that test the norm: massive activations, a zero row, a tiny row."""
    x = randn(gen, rows, n)
    if rows > 1:
        x[0] *= 1000.0  # float16 x^2 overflows past 256
        x[1] = 0.0  # 0 * rsqrt(eps): finite only with eps inside the root
    if rows > 2:
        x[2] *= 1e-3  # mean(x^2) ~ 1e-6 < eps: a misplaced eps shows
    return x.to(dtype)


def _wide(x: torch.Tensor, extra: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as a row-strided view into a wider tensor (returned too: its gaps must stay untouched)."""
    base = torch.full((x.shape[0], x.shape[1] + extra), 7.0).to(x.dtype)
    base[:, : x.shape[1]] = x
    return base, base[:, : x.shape[1]]


def _to(dev: torch.device, *ts: torch.Tensor) -> list[torch.Tensor]:
    """Copies on the device (never the host tensors themselves: they are the reference's inputs)."""
    return [t.to(dev, copy=True) for t in ts]


def _fresh(check, outs: tuple[torch.Tensor, ...], ins: tuple[torch.Tensor, ...], what: str) -> None:
    """No result shares memory with an input (results are new tensors)."""
    held = {t.untyped_storage().data_ptr() for t in ins}
    for i, o in enumerate(outs):
        assert o.untyped_storage().data_ptr() not in held, (
            f"{what}: result {i} shares memory with an input (the contract: results are new tensors, inputs "
            f"are never written)")


def _untouched(check, ins: dict[str, torch.Tensor], before: dict[str, torch.Tensor], what: str) -> None:
    for name, t in ins.items():
        check.exact(t.cpu(), before[name], "elementwise_exact", f"{what}: input {name} written by the op")


@pytest.mark.parametrize("rows,n", NORM_SIZES, ids=[f"{r}x{n}" for r, n in NORM_SIZES])
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_rms_norm(backend, check, gen, dtype, op, rows, n):
    """RMSNorm of a row-strided hidden state, and with the residual add (``h = x + residual`` is one
    rounding in the dtype, as torch's add: bit-exact)."""
    check.capability = f"elementwise/{op}"
    ops = _ops(backend)
    dev = backend.device.torch_device
    x = _hidden(gen, rows, n, dtype)
    w = (1 + 0.2 * randn(gen, n)).to(dtype)
    eps = 1e-6 if n > 4096 else EPS
    if op == "rms_norm":
        base, view = _wide(x)
        b_base, b_w = _to(dev, base, w)
        got = ops.rms_norm(b_base[:, :n], b_w, eps)
        ins = {"x (and its row gaps)": b_base, "weight": b_w}
        want = rms_norm(view, w, eps)
    else:
        res = randn(gen, rows, n).to(dtype)
        if rows > 1:
            x[1] = -res[1]  # h = 0 exactly
        base, res_view = _wide(res, extra=5)
        b_x, b_base, b_w = _to(dev, x, base, w)
        got = ops.add_rms_norm(b_x, b_base[:, :n], b_w, eps)
        ins = {"x": b_x, "residual (and its row gaps)": b_base, "weight": b_w}
        want = add_rms_norm(x, res_view, w, eps)
    if got is None:
        not_supported(f"{op} returns None for {str(dtype).removeprefix('torch.')} [{rows}, {n}] (the compiled "
                      f"function runs)")
    backend.device.synchronize()
    before = {"x (and its row gaps)": base, "weight": w} if op == "rms_norm" else {
        "x": x, "residual (and its row gaps)": base, "weight": w}
    _untouched(check, ins, before, op)
    outs = (got,) if op == "rms_norm" else tuple(got)
    _fresh(check, outs, tuple(ins.values()), op)
    y, want_y = outs[0], want if op == "rms_norm" else want[0]
    assert y.dtype == want_y.dtype, f"{op}: result dtype {y.dtype} != the model function's {want_y.dtype}"
    assert tuple(y.shape) == (rows, n), f"{op}: result shape {tuple(y.shape)} != {(rows, n)}"
    check.close(y.cpu(), want_y, dtype, "elementwise", f"{op} [{rows}, {n}]", same_dtype_reference=True)
    if op == "add_rms_norm":
        h = outs[1]
        assert h.dtype == dtype and tuple(h.shape) == (rows, n), f"add_rms_norm: sum {h.dtype} {tuple(h.shape)}"
        check.exact(h.cpu(), want[1], "elementwise_exact", "add_rms_norm: the residual sum x + residual")


@pytest.mark.parametrize("rows,inter", NORM_SIZES, ids=[f"{r}x{n}" for r, n in NORM_SIZES])
def test_silu_mul(backend, check, gen, dtype, rows, inter):
    """``silu(gate) * up`` of the fused gate_up output, gate values to +-30 (exp's range)."""
    check.capability = "elementwise/silu_mul"
    ops = _ops(backend)
    gu = (randn(gen, rows, 2 * inter) * 8).to(dtype)
    (b_gu,) = _to(backend.device.torch_device, gu)
    got = ops.silu_mul(b_gu, inter)
    if got is None:
        not_supported(f"silu_mul returns None for {str(dtype).removeprefix('torch.')} [{rows}, 2 x {inter}]")
    backend.device.synchronize()
    _untouched(check, {"gate_up": b_gu}, {"gate_up": gu}, "silu_mul")
    _fresh(check, (got,), (b_gu,), "silu_mul")
    want = silu_mul(gu, inter)
    assert got.dtype == want.dtype and tuple(got.shape) == (rows, inter), (
        f"silu_mul: result {got.dtype} {tuple(got.shape)} != {want.dtype} {(rows, inter)}")
    check.close(got.cpu(), want, dtype, "elementwise", f"silu_mul [{rows}, {inter}]", same_dtype_reference=True)


def _rope_inputs(gen: torch.Generator, t: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype):
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(MAX_POS, dtype=torch.float32)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    qkv = randn(gen, t, (heads + 2 * kv_heads) * d, dtype=dtype)
    edge = torch.tensor([0, MAX_POS - 1, 1 << 15, (1 << 16) + 3])
    pos = torch.cat([edge, torch.randint(0, MAX_POS, (t,), generator=gen)])[torch.randperm(t + 4, generator=gen)][:t]
    pos[: min(t, 2)] = edge[[1, 3]][: min(t, 2)]  # the largest positions always there
    return cos, sin, pos, qkv


def _qk(qkv: torch.Tensor, heads: int, kv_heads: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as Attention.project makes them: views of the fused output with its row stride."""
    t = qkv.shape[0]
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return q.view(t, heads, d), k.view(t, kv_heads, d)


@pytest.mark.parametrize("heads,kv_heads", ROPE_HEADS, ids=[f"h{h}kv{k}" for h, k in ROPE_HEADS])
def test_rope(backend, check, gen, dtype, head_size, heads, kv_heads):
    """Neox RoPE of q and k (views of the fused qkv output) by the rows ``positions`` of the cos/sin cache;
    7 tokens (a prefill chunk) and 1 (a decode)."""
    check.capability = "elementwise/rope"
    ops = _ops(backend)
    t = 7 if heads == 4 else 1
    cos, sin, pos, qkv = _rope_inputs(gen, t, heads, kv_heads, head_size, dtype)
    b_cos, b_sin, b_pos, b_qkv = _to(backend.device.torch_device, cos, sin, pos, qkv)
    got = ops.rope(b_cos, b_sin, b_pos, *_qk(b_qkv, heads, kv_heads, head_size))
    if got is None:
        not_supported(f"rope returns None for {str(dtype).removeprefix('torch.')} head size {head_size}, "
                      f"{heads}/{kv_heads} heads")
    backend.device.synchronize()
    _untouched(check, {"qkv (q, k and v)": b_qkv, "cos": b_cos, "sin": b_sin, "positions": b_pos},
               {"qkv (q, k and v)": qkv, "cos": cos, "sin": sin, "positions": pos}, "rope")
    _fresh(check, tuple(got), (b_qkv, b_cos, b_sin, b_pos), "rope")
    want = apply_rope(cos, sin, pos, *_qk(qkv, heads, kv_heads, head_size))
    for name, g, w in zip("qk", got, want):
        assert g.dtype == dtype and tuple(g.shape) == tuple(w.shape), (
            f"rope {name}: result {g.dtype} {tuple(g.shape)} != {dtype} {tuple(w.shape)}")
        assert g.is_contiguous(), f"rope {name}: result not contiguous (strides {g.stride()}); the contract: " \
                                  f"contiguous [T, H, D]"
        check.close(g.cpu(), w, dtype, "elementwise", f"rope {name} [{t}, {g.shape[1]}, {head_size}]",
                    same_dtype_reference=True)


def test_elementwise_in_graph(backend, check, gen):
    """All four ops captured into one graph, replayed after every input changed in place (new values,
    new positions): each replay computes on the new contents. A host synchronisation in an op (a
    ``.item()`` bounds check, a ``.tolist()`` of the positions) fails the capture."""
    check.capability = "elementwise/graph"
    caps = backend.capabilities
    if not caps.graph_capture:
        not_supported("Capabilities.graph_capture is False: the backend declares no graph capture")
    ops = _ops(backend)
    dev = backend.device
    on = dev.torch_device
    dtype = torch.bfloat16 if torch.bfloat16 in caps.dtypes else caps.dtypes[0]
    rows, n, heads, kv_heads, d = 5, 96, 3, 1, 64
    cos, sin, pos, qkv = _rope_inputs(gen, rows, heads, kv_heads, d, dtype)
    cos, sin = cos[:4096].contiguous(), sin[:4096].contiguous()
    pos = pos % 4096
    x, res, w = _hidden(gen, rows, n, dtype), randn(gen, rows, n, dtype=dtype), (1 + 0.2 * randn(gen, n)).to(dtype)
    gu = (randn(gen, rows, 2 * n) * 8).to(dtype)
    s = {k: v.to(on, copy=True) for k, v in dict(x=x, res=res, w=w, gu=gu, cos=cos, sin=sin, pos=pos, qkv=qkv).items()}

    def step():
        return (ops.rms_norm(s["x"], s["w"], EPS), ops.add_rms_norm(s["x"], s["res"], s["w"], EPS),
                ops.silu_mul(s["gu"], n), ops.rope(s["cos"], s["sin"], s["pos"], *_qk(s["qkv"], heads, kv_heads, d)))

    if any(o is None for o in step()):  # also the warm-up: kernels compile outside the capture
        not_supported(f"an op returns None for {str(dtype).removeprefix('torch.')} (the compiled function runs)")
    dev.synchronize()
    graph, outs = dev.capture_graph(step, dev.graph_pool(), dev.new_stream())
    for trial in range(2):
        new = dict(x=_hidden(gen, rows, n, dtype).flip(0), res=randn(gen, rows, n, dtype=dtype),
                   w=(1 + 0.2 * randn(gen, n)).to(dtype), gu=(randn(gen, rows, 2 * n) * 8).to(dtype),
                   pos=torch.randint(0, 4096, (rows,), generator=gen), qkv=randn(gen, *qkv.shape, dtype=dtype))
        for k, v in new.items():
            s[k].copy_(v.to(on))
        graph.replay()
        dev.synchronize()
        want = (rms_norm(new["x"], new["w"], EPS), add_rms_norm(new["x"], new["res"], new["w"], EPS),
                silu_mul(new["gu"], n), apply_rope(cos, sin, new["pos"], *_qk(new["qkv"], heads, kv_heads, d)))
        for name, g, e in (("rms_norm", outs[0], want[0]), ("add_rms_norm", outs[1][0], want[1][0]),
                           ("silu_mul", outs[2], want[2]), ("rope q", outs[3][0], want[3][0]),
                           ("rope k", outs[3][1], want[3][1])):
            check.close(g.cpu(), e, dtype, "elementwise", f"{name} replayed from a graph (replay {trial})",
                        same_dtype_reference=True)
        check.exact(outs[1][1].cpu(), want[1][1], "elementwise_exact", f"add_rms_norm sum, replay {trial}")
    del graph


LINEAR_SHAPES = [(256, 2048, 2048, False), (200, 3072, 1024, True), (64, 1024, 4096, False)]  # (tokens, N, K, bias)


@pytest.mark.parametrize("m,n,k,bias", LINEAR_SHAPES, ids=[f"{m}x{n}x{k}{'+b' if b else ''}" for m, n, k, b in
                                                             LINEAR_SHAPES])
def test_linear(backend, check, gen, dtype, m, n, k, bias):
    """The optional many-token product (``linear``): ``F.linear`` of a row-strided hidden state within one rounding
    of the float64 product, the same bits on a second call (a split-K sum in an order set by the scheduling gives
    other bits from call to call, so a step's tokens would depend on timing), inputs untouched, a new result."""
    check.capability = "elementwise/linear"
    ops = _ops(backend)
    if getattr(ops, "linear", None) is None:
        not_supported("the backend's ElementwiseOps has no linear (optional)")
    x = randn(gen, m, k, dtype=dtype)
    w = (randn(gen, n, k) / k**0.5).to(dtype)
    b = randn(gen, n, dtype=dtype) if bias else None
    ins = [x, w] + ([b] if bias else [])
    dev_ins = _to(backend.device.torch_device, *ins)
    wide, bx = _wide(dev_ins[0])
    got = ops.linear(bx, dev_ins[1], dev_ins[2] if bias else None)
    if got is None:
        not_supported(f"linear returns None for {str(dtype).removeprefix('torch.')} [{m}, {k}] x [{n}, {k}]")
    again = ops.linear(bx, dev_ins[1], dev_ins[2] if bias else None)
    backend.device.synchronize()
    _untouched(check, {"x": bx, "weight": dev_ins[1]}, {"x": x, "weight": w}, "linear")
    _fresh(check, (got,), (wide, *dev_ins[1:]), "linear")
    check.exact(again.cpu(), got.cpu(), "elementwise_exact", "linear: a second call with the same inputs")
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).to(dtype)
    assert got.dtype == dtype and tuple(got.shape) == (m, n), f"linear: result {got.dtype} {tuple(got.shape)}"
    check.close(got.cpu(), want, dtype, "elementwise", f"linear [{m}, {k}] x [{n}, {k}]", same_dtype_reference=True)

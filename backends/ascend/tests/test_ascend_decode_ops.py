"""Ascend DecodeOps on the emulated dense ops: the conformance decode-ops check, qkv at the Ascend
block size with padding slots, which ops run, validation, and the dense ops' own rules."""

from __future__ import annotations

import pytest
import torch

import conformance
from conformance.tolerances import ToleranceTable
from hwkv.interfaces import KVCacheSpec, KVLayoutKind
from hwkv.model.decode_ops import TorchDecodeOps


def spy(mod, name):
    calls, real = [], getattr(mod, name)
    setattr(mod, name, lambda *a, **kw: (calls.append((a, kw)), real(*a, **kw))[1])
    return calls


def test_conformance_decode_ops_pass_on_emulator(npu, tmp_path):
    report = conformance.run("ascend", report_dir=tmp_path, pytest_args=["-k", "test_decode_op"])
    rows = [t for t in report["tests"] if t["capability"].startswith("decode_ops/")]
    bad = [(t["id"], t["status"], t["reason"]) for t in rows if t["status"] not in ("PASS", "NOT_SUPPORTED")]
    assert rows and bad == []
    passed = {t["capability"] for t in rows if t["status"] == "PASS"}
    assert {"decode_ops/linear", "decode_ops/norm_linear", "decode_ops/silu_linear"} <= passed, passed
    for t in rows:  # only what the backend declares out, and the optional argmax it does not offer
        if t["status"] == "NOT_SUPPORTED":
            declared = "float32 not supported" in t["reason"] or "block_size 16 not supported" in t["reason"]
            optional = t["capability"] == "decode_ops/argmax" and "argmax is not offered" in t["reason"]
            assert declared or optional, t


def _qkv_case(dtype, head_dim, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, hidden, blocks = 4, 2, 96, 3
    n = (heads + 2 * kv_heads) * head_dim
    ang = torch.arange(64)[:, None] * (1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    slots = torch.randperm(blocks * 128, generator=g)[:tokens]
    slots[0] = -1  # padding: never written, never handed to the kernel
    return dict(h=torch.randn(tokens, hidden, generator=g).to(dtype),
                nw=(1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype),
                w=(torch.randn(n, hidden, generator=g) / hidden**0.5).to(dtype),
                b=torch.randn(n, generator=g).to(dtype), cos=ang.cos().to(dtype), sin=ang.sin().to(dtype),
                pos=torch.randperm(64, generator=g)[:tokens], slots=slots,
                spec=KVCacheSpec(1, blocks, 128, kv_heads, head_dim, dtype), heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 192])
def test_qkv_matches_the_torch_reference_at_block_128(npu, dtype, head_dim):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    ops = backend.decode_ops()
    c = _qkv_case(dtype, head_dim, tokens=5)
    outs, caches = [], []
    for fused in (ops, TorchDecodeOps()):
        kv = backend.device.allocate_kv_cache(c["spec"], KVLayoutKind.SEPARATE_KV)
        impl = backend.attention.make_impl(c["heads"], head_dim, c["kv_heads"], head_dim**-0.5)
        outs.append(fused.qkv(c["h"], c["nw"], 1e-5, c["w"], c["b"], c["cos"], c["sin"], c["pos"], impl,
                              kv.layer(0), c["slots"], c["heads"], c["kv_heads"], head_dim))
        caches.append(kv.layer(0))
    tol = ToleranceTable().get(dtype, "decode_ops")
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol.atol, rtol=tol.rtol)
    written = c["slots"][1:]
    for got, want in zip(caches[0], caches[1]):
        flat_got, flat_want = got.view(-1, c["kv_heads"], head_dim), want.view(-1, c["kv_heads"], head_dim)
        torch.testing.assert_close(flat_got[written].float(), flat_want[written].float(), atol=tol.atol, rtol=tol.rtol)
        assert int(flat_got.reshape(flat_got.shape[0], -1).any(dim=1).sum()) == written.numel()


def test_the_fused_ops_are_the_ones_vllm_ascend_uses(npu):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    ops = backend.decode_ops()
    norm, rope, swiglu = spy(npu, "npu_rms_norm"), spy(npu, "npu_rotary_mul"), spy(npu, "npu_swiglu")
    c = _qkv_case(torch.float16, 64, tokens=3)
    kv = backend.device.allocate_kv_cache(c["spec"], KVLayoutKind.SEPARATE_KV)
    impl = backend.attention.make_impl(4, 64, 2, 0.125)
    ops.qkv(c["h"], c["nw"], 1e-5, c["w"], c["b"], c["cos"], c["sin"], c["pos"], impl, kv.layer(0), c["slots"],
            4, 2, 64)
    assert len(norm) == 1 and len(rope) == 2 and swiglu == []
    (x, r1, r2), _ = rope[0]
    assert x.shape == (1, 3, 4, 64) and r1.shape == r2.shape == (1, 3, 1, 64)  # BSND, cos/sin 1S1D
    ops.silu_linear(torch.randn(3, 20).half(), torch.randn(7, 10).half(), None, torch.randn(3, 7).half())
    assert len(swiglu) == 1 and swiglu[0][1] == {"dim": -1}


def test_validate_and_missing_ops(npu):
    from hwkv_ascend.backend import AscendBackend

    ops = AscendBackend().decode_ops()
    assert ops.validate(4, 2, 64, torch.float16, torch.float16) == []
    reasons = ops.validate(4, 2, 63, torch.float64, torch.float16)
    assert reasons[0].startswith("dtype torch.float64") and "even head dim < 896" in reasons[1]
    assert "KV cache dtype torch.float16 differs" in reasons[2]
    del npu.npu_rotary_mul  # a torch_npu without the op: the engine runs the model's torch ops
    assert AscendBackend().decode_ops() is None


def test_dense_op_rules(emulator):
    d = emulator._dense_ops()
    x = torch.randn(3, 8).half()
    with pytest.raises(RuntimeError, match="gamma shape"):
        d.npu_rms_norm(x, torch.ones(4).half())
    with pytest.raises(RuntimeError, match="gamma dtype"):
        d.npu_rms_norm(x, torch.ones(8))
    y, rstd = d.npu_rms_norm(x, torch.ones(8).half(), epsilon=1e-5)
    assert y.dtype == torch.float16 and rstd.shape == (3, 1) and rstd.dtype == torch.float32
    y2, _, s = d.npu_add_rms_norm(x, x, torch.ones(8).half(), 1e-5)
    assert torch.equal(s, x + x) and torch.allclose(y2.float(), y.float(), atol=2e-3)
    q = torch.randn(1, 3, 2, 6).half()
    with pytest.raises(RuntimeError, match="must be 4-D"):
        d.npu_rotary_mul(q[0], q[:, :, :1], q[:, :, :1])
    with pytest.raises(RuntimeError, match="1S1D, BS1D or BSND"):
        d.npu_rotary_mul(q, torch.ones(1, 1, 1, 6).half(), torch.ones(1, 1, 1, 6).half())
    with pytest.raises(RuntimeError, match="D even and < 896"):
        d.npu_rotary_mul(torch.randn(1, 3, 2, 5).half(), torch.ones(1, 3, 1, 5).half(), torch.ones(1, 3, 1, 5).half())
    with pytest.raises(RuntimeError, match="must be even"):
        d.npu_swiglu(torch.randn(2, 7))
    g = torch.randn(2, 8)
    torch.testing.assert_close(d.npu_swiglu(g), torch.nn.functional.silu(g[:, :4]) * g[:, 4:])

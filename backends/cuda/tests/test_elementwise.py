"""The Triton elementwise ops (RMSNorm + residual, RoPE, SiLU·mul) against the model's torch functions:
interpreter mode on CPU (float32), the real kernels on a GPU (bf16 too, where they round as torch does)."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda.elementwise import TritonElementwise  # noqa: E402

from hwkv.model.layers import add_rms_norm, rms_norm, silu_mul  # noqa: E402
from hwkv.model.rope import apply_rope  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 only on the GPU: the interpreter's fp32 -> bf16 casts are not the hardware's (test_decode_ops.py)
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


def _close(got, want, dtype, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)
    assert err < TOL[dtype], f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 96), (3, 2048)])
def test_norms_and_silu_mul_match_torch(rows, n, dtype):
    gen = torch.Generator().manual_seed(rows * n)
    ops = TritonElementwise(DEV)
    x, r = (torch.randn(rows, n, generator=gen).to(DEV, dtype) for _ in range(2))
    w = (torch.rand(n, generator=gen) + 0.5).to(DEV, dtype)
    _close(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6), dtype, "rms_norm")
    got, h = ops.add_rms_norm(x, r, w, 1e-5)
    want, want_h = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual sum is one rounding, as torch's
    _close(got, want, dtype, "add_rms_norm")
    gu = torch.randn(rows, 2 * n, generator=gen).to(DEV, dtype) * 3
    _close(ops.silu_mul(gu, n), silu_mul(gu, n), dtype, "silu_mul")
    view = torch.randn(rows, 3 * n, generator=gen).to(DEV, dtype)[:, :n]  # a row stride wider than the row
    _close(ops.rms_norm(view, w, 1e-6), rms_norm(view, w, 1e-6), dtype, "rms_norm of a strided view")


def _rope_case(heads: int, kv_heads: int, d: int, t: int, dtype: torch.dtype, seed: int):
    """``(cos, sin, q, k)``: rotary tables of 64 positions, and q / k as views of one ``[t, qkv]`` row
    with the qkv row stride (as Attention.project makes them)."""
    gen = torch.Generator().manual_seed(seed)
    ang = torch.arange(64)[:, None] * (1.0 / 100 ** (torch.arange(0, d, 2) / d))[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen).to(DEV, dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return cos, sin, q.view(t, heads, d), k.view(t, kv_heads, d)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (3, 1, 40), (32, 8, 64)])
def test_rope_of_qkv_views_matches_torch(heads, kv_heads, d, dtype):
    cos, sin, q, k = _rope_case(heads, kv_heads, d, 5, dtype, heads * d)
    pos = torch.tensor([0, 7, 63, 1, 30], device=DEV)
    got_q, got_k = TritonElementwise(DEV).rope(cos, sin, pos, q, k)
    want_q, want_k = apply_rope(cos, sin, pos, q, k)
    _close(got_q, want_q, dtype, "rope q")
    _close(got_k, want_k, dtype, "rope k")
    assert got_q.is_contiguous() and got_k.is_contiguous()


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (3, 1, 40), (32, 8, 64), (2, 64, 32)])
def test_rope_of_q_and_k_in_one_launch_is_the_two_launches_bits(heads, kv_heads, d, monkeypatch):
    """The default rope (q and k in one launch, rope_qk_kernel) gives the same bits as a launch each
    (HWKV_CUDA_ROPE_QK=0), also when k has more head blocks than q."""
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16
    t = 6
    cos, sin, q, k = _rope_case(heads, kv_heads, d, t, dtype, heads + d)
    pos = torch.tensor([0, 7, 63, 1, 30, 5], device=DEV)
    ops = TritonElementwise(DEV)
    monkeypatch.setenv("HWKV_CUDA_ROPE_QK", "1")
    one_q, one_k = ops.rope(cos, sin, pos, q, k)
    monkeypatch.setenv("HWKV_CUDA_ROPE_QK", "0")
    two_q, two_k = ops.rope(cos, sin, pos, q, k)
    assert torch.equal(one_q, two_q) and torch.equal(one_k, two_k)
    assert (one_q.shape, one_k.shape) == ((t, heads, d), (t, kv_heads, d))


def test_refuses_what_it_does_not_take():
    """None (the compiled function runs) for what the kernels do not cover; never a wrong result."""
    ops = TritonElementwise(DEV)
    x = torch.randn(2, 3, 8, device=DEV)
    assert ops.rms_norm(x, torch.ones(8, device=DEV), 1e-6) is None  # per-head norms (3-D)
    assert ops.rms_norm(torch.randn(2, 8, device=DEV, dtype=torch.float64), torch.ones(8, device=DEV,
                        dtype=torch.float64), 1e-6) is None
    assert ops.silu_mul(torch.randn(2, 10, device=DEV), 4) is None  # not [gate | up] of width 2 * inter
    q = torch.randn(2, 2, 7, device=DEV)  # odd head size
    assert ops.rope(torch.ones(4, 7, device=DEV), torch.ones(4, 7, device=DEV), torch.zeros(2, dtype=torch.long,
                    device=DEV), q, q) is None
    other = "cpu" if DEV == "cuda" else "meta"
    assert TritonElementwise(other).rms_norm(torch.randn(2, 8, device=DEV), torch.ones(8, device=DEV), 1e-6) is None


def test_fuse_elementwise_takes_kernels_first_and_falls_back():
    """hwkv.model.fuse: a backend op that answers is used; one that returns None leaves the compiled
    function in place (here: eager torch through backend="eager")."""
    from hwkv.model.fuse import _first

    calls = []

    class Ops:
        def silu_mul(self, gate_up, inter):
            calls.append(gate_up.shape[0])
            return None if gate_up.shape[0] == 3 else torch.zeros(gate_up.shape[0], inter)

    f = _first(Ops(), "silu_mul", silu_mul)
    assert torch.equal(f(torch.ones(2, 8), 4), torch.zeros(2, 4))
    gu = torch.randn(3, 8)
    assert torch.equal(f(gu, 4), silu_mul(gu, 4)) and calls == [2, 3]
    assert _first(None, "silu_mul", silu_mul) is silu_mul and _first(Ops(), "rope", apply_rope) is apply_rope


@pytest.mark.skipif(DEV == "cuda", reason="the CPU reference engine with the kernels under Triton's interpreter")
def test_engine_with_the_kernels_gives_the_same_tokens(tmp_path):
    """A whole engine (CPU reference backend, float32) with the kernels patched in through
    fuse_elementwise: every norm, RoPE and SiLU·mul call ran a kernel, and greedy tokens equal the
    unfused engine's (prefill and decode, batches of several requests)."""
    import hwkv
    from hwkv.model.fuse import fuse_elementwise
    from hwkv.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "m", intermediate_size=96)
    prompts = [[(7 * i + j) % 500 + 1 for j in range(5 + 3 * i)] for i in range(3)]
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kw = dict(backend="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64)
    want = [o.token_ids for o in hwkv.Engine(str(path), **kw).generate(prompts, params, use_tqdm=False)]

    class Counting(TritonElementwise):
        ran: dict = {}

        def __getattribute__(self, name):
            fn = super().__getattribute__(name)
            if name not in ("rms_norm", "add_rms_norm", "rope", "silu_mul"):
                return fn

            def call(*a):
                out = fn(*a)
                Counting.ran[name] = Counting.ran.get(name, 0) + (out is not None)
                return out
            return call

    e = hwkv.Engine(str(path), **kw)
    torch._dynamo.reset()
    try:
        fuse_elementwise(e.model, backend="eager", kernels=Counting("cpu"))
        assert [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)] == want
    finally:
        torch._dynamo.reset()
    assert set(Counting.ran) == {"rms_norm", "add_rms_norm", "rope", "silu_mul"} and min(Counting.ran.values()) > 0


def test_logits_float32_out():
    """The LM head's float32 logits: cuBLAS's float32 output on a GPU (within bf16's rounding of the model's
    ``F.linear(x, w).float()``, argmax equal), ``None`` for what it does not take (float32 inputs, CPU tensors)."""
    gen = torch.Generator().manual_seed(3)
    x32, w32 = torch.randn(7, 256, generator=gen), torch.randn(1000, 256, generator=gen) / 16
    assert TritonElementwise(DEV).logits(x32.to(DEV), w32.to(DEV)) is None  # float32: the model's path
    assert TritonElementwise("cpu").logits(x32.bfloat16(), w32.bfloat16()) is None  # no float32-out GEMM on CPU
    if DEV != "cuda":
        return
    x, w = x32.to(DEV, torch.bfloat16), w32.to(DEV, torch.bfloat16)
    got, want = TritonElementwise(DEV).logits(x, w), torch.nn.functional.linear(x, w).float()
    assert got.dtype == torch.float32 and got.shape == (7, 1000)
    exact = x.double() @ w.double().t()
    assert (got.double() - exact).abs().max() <= (want.double() - exact).abs().max()  # no bf16 rounding
    assert (got - want).abs().max() <= want.abs().max() * 2**-7


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the real kernels run the section (hwkv conformance --backend cuda)")
def test_conformance_section_passes_in_the_interpreter():
    """The suite's elementwise section (conformance/test_elementwise.py: odd widths, strided rows, qkv views,
    positions past 2^16, inputs untouched, new results) against these kernels under Triton's interpreter;
    float32 and float16 only (the interpreter's bf16 casts truncate, unlike the hardware's)."""
    import conformance
    from hwkv.reference import CpuBackend

    class Interpreted(CpuBackend):
        name = "cpu-triton-elementwise"

        def elementwise_ops(self):
            return TritonElementwise("cpu")

    report = conformance.run(Interpreted(), pytest_args=["-q", "-k", "test_elementwise and not bfloat16"])
    got = {t["id"]: t["status"] for t in report["tests"]}
    graph = "test_elementwise.py::test_elementwise_in_graph"
    assert got.pop(graph) == "NOT_SUPPORTED"  # the host device declares no graph capture
    # the optional many-token linear (27c4328) declines while HWKV_CUDA_GEMM is off, its default; its kernel has
    # its own interpreter tests (test_gemm.py)
    linear = {i: got.pop(i) for i in [i for i in got if "::test_linear[" in i]}
    assert linear and set(linear.values()) == {"NOT_SUPPORTED"}, linear
    assert len(got) >= 24 and set(got.values()) == {"PASS"}, {i: s for i, s in got.items() if s != "PASS"}


def test_pdl_launch_is_opt_in_and_gpu_only(monkeypatch):
    """HWKV_CUDA_ELEMENTWISE_PDL=1 asks for programmatic dependent launch (the kernels wait for the previous kernel's
    writes first); off, or on CPU tensors, the kernels launch plainly. With it on, the ops give the same values."""
    ops = TritonElementwise(DEV)
    x = torch.randn(4, 64, device=DEV)
    monkeypatch.setenv("HWKV_CUDA_ELEMENTWISE_PDL", "0")
    assert ops._pdl(x) == {}
    w = torch.randn(64, device=DEV)
    want = ops.rms_norm(x, w, 1e-6)
    monkeypatch.setenv("HWKV_CUDA_ELEMENTWISE_PDL", "1")
    if DEV == "cpu":
        assert ops._pdl(x) == {}
    assert torch.equal(ops.rms_norm(x, w, 1e-6), want)

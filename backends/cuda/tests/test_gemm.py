"""The split-K linear (hwkv_cuda.gemm) against float64 matmuls: interpreter mode on CPU (small tiles through
``HWKV_CUDA_GEMM_CONFIG``), the real kernel with the chosen tiles on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda.gemm import CONFIG_ENV, COUNTERS, ENV, SplitKLinear, choose  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float16  # the interpreter's bf16 casts are not the hardware's


def _want(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _check(got, want, dtype):
    assert got is not None and got.dtype == dtype
    err = (got.double() - want).norm() / want.norm()
    assert err < 4e-3, f"rel err {err:.2e}"


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_matches_matmul_and_leaves_counters_zero(monkeypatch, split, bias):
    monkeypatch.setenv(ENV, "1")
    if DEV == "cpu":
        monkeypatch.setenv(CONFIG_ENV, f"block_m=16,block_n=16,block_k=32,split_k={split},num_warps=4,num_stages=1")
    else:
        monkeypatch.setenv(CONFIG_ENV, f"split_k={split}")
    m, n, k = (37, 40, 256) if DEV == "cpu" else (200, 2048, 4096)  # rows and columns not whole tiles
    gen = torch.Generator().manual_seed(split * 2 + bias)
    x = torch.randn(m, k, generator=gen).to(DEV, DT)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, DT)
    b = torch.randn(n, generator=gen).to(DEV, DT) if bias else None
    op = SplitKLinear(DEV)
    y = op(x, w, b)
    _check(y, _want(x, w, b), DT)
    assert torch.equal(op(x, w, b), y)  # the partials are summed in split order, whichever program is last
    if split > 1:
        assert len(op._cnt) == 1 and int(next(iter(op._cnt.values())).abs().sum()) == 0


def test_row_strided_input(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    if DEV == "cpu":
        monkeypatch.setenv(CONFIG_ENV, "block_m=16,block_n=16,block_k=32,split_k=2,num_warps=4,num_stages=1")
    m, n, k = (20, 32, 128) if DEV == "cpu" else (256, 2048, 2048)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, 3 * k, generator=gen).to(DEV, DT)[:, k:2 * k]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEV, DT)
    _check(SplitKLinear(DEV)(x, w), _want(x, w, None), DT)


def test_declines_what_it_does_not_take(monkeypatch):
    x = torch.randn(256, 2048, dtype=DT, device=DEV)
    w = torch.randn(2048, 2048, dtype=DT, device=DEV)
    op = SplitKLinear(DEV)
    monkeypatch.delenv(ENV, raising=False)
    assert op(x, w) is None  # off unless switched on
    monkeypatch.setenv(ENV, "1")
    assert op(x.float(), w.float()) is None  # 16-bit only
    assert op(x.t(), w) is None  # rows must be contiguous along K
    assert op(x, w[:, :1024]) is None  # K mismatch
    monkeypatch.setenv(CONFIG_ENV, "block_k=64,split_k=3")
    assert op(x, w) is None  # K not in whole tiles per split
    monkeypatch.setenv(CONFIG_ENV, "split_k=x")
    with pytest.raises(ValueError, match=CONFIG_ENV):
        op(x, w)


def test_choose_splits_only_narrow_grids():
    # the 1B shape at 256 tokens on 132 SMs: o_proj and down split 4, qkv 2, gate_up fills the SMs (cuBLAS)
    assert choose(256, 2048, 2048, 132).split_k == 4
    assert choose(256, 2048, 8192, 132).split_k == 4
    assert choose(256, 3072, 2048, 132).split_k == 2
    assert choose(256, 16384, 2048, 132) is None
    assert choose(8, 2048, 2048, 132) is None  # few rows: the GEMV path
    assert choose(64, 4096, 14336, 132).block_m == 64
    assert choose(128, 4096, 100, 132) is None  # no whole split of K
    assert COUNTERS >= 132


def test_blaslt_switch_runs_f_linear_on_cuda_only(monkeypatch):
    """HWKV_CUDA_BLASLT=1: the elementwise ops' linear is F.linear under cuBLASLt (on a GPU: the product, and the
    preferred BLAS library restored after the call); off, or on CPU tensors, it declines (None: the model's
    F.linear)."""
    from hwkv_cuda.elementwise import BLASLT_ENV, TritonElementwise

    monkeypatch.delenv(ENV, raising=False)
    x = torch.randn(256, 64, device=DEV).to(DT)
    w = torch.randn(32, 64, device=DEV).to(DT)
    b = torch.randn(32, device=DEV).to(DT)
    ops = TritonElementwise(DEV)
    monkeypatch.setenv(BLASLT_ENV, "0")
    assert ops.linear(x, w, b) is None
    monkeypatch.setenv(BLASLT_ENV, "1")
    if DEV == "cpu":
        assert ops.linear(x, w, b) is None
        return
    before = torch.backends.cuda.preferred_blas_library()
    _check(ops.linear(x, w, b), _want(x, w, b), DT)
    assert torch.backends.cuda.preferred_blas_library() == before

"""The fused decode ops (Triton GEMV with norm / SiLU prologues and residual / RoPE+KV epilogues)
against their torch reference, op by op: interpreter mode on CPU, the real kernels on a GPU."""

import os

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from hwkv_cuda.decode_ops import TritonDecodeOps, choose_config  # noqa: E402

from hwkv.model.decode_ops import TorchDecodeOps  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 is exact up to summation order; bf16 may differ by about one rounding step (2^-8)
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}
# bf16 only on the GPU: the interpreter's fp32 -> bf16 casts are not the hardware's round-to-nearest
# (measured 0.8% off an fp64 truth where torch is 0.14%), so they would test the emulation
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def _rand(*shape, dtype, scale=1.0, gen):
    return (torch.randn(*shape, generator=gen) * scale).to(DEV, dtype)


def _close(got, want, dtype, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    err = (got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)
    assert err < TOL[dtype], f"{what}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cfg", ["", "block_k=32,preload=0", "block_k=32,preload=1", "block_k=32,preload=2",
                                 "block_k=32,preload=1,evict=1", "block_k=16,split_k=2,preload=2",
                                 "block_k=16,split_k=2,preload=0", "block_k=32,maxnreg=64",
                                 "block_n=8,stream=1,preload=0", "block_n=4,stream=2,preload=1",
                                 "block_n=4,stream=1,preload=2", "block_n=8,stream=2,l2pf=2",
                                 "block_n=4,block_k=32,stream=2,l2pf=2"])
def test_linear_ops_match_torch(m, bias, dtype, cfg, monkeypatch):
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", cfg)
    gen = torch.Generator().manual_seed(m + 10 * bias)
    k, n = 96, 40  # K not a power of two, N not a multiple of the row block
    fused, ref = TritonDecodeOps(), TorchDecodeOps()
    w, b = _rand(n, k, dtype=dtype, scale=0.1, gen=gen), _rand(n, dtype=dtype, gen=gen) if bias else None
    x, res, nw = _rand(m, k, dtype=dtype, gen=gen), _rand(m, n, dtype=dtype, gen=gen), _rand(k, dtype=dtype, gen=gen)
    gu = _rand(m, 2 * k, dtype=dtype, gen=gen)
    _close(fused.linear(x, w, b, res), ref.linear(x, w, b, res), dtype, "linear")
    _close(fused.norm_linear(x, nw, 1e-6, w, b), ref.norm_linear(x, nw, 1e-6, w, b), dtype, "norm_linear")
    _close(fused.silu_linear(gu, w, b, res), ref.silu_linear(gu, w, b, res), dtype, "silu_linear")


def test_split_k_applies_where_it_can_and_leaves_its_counters_zero(monkeypatch):
    """split_k runs a row block as several programs over parts of K (summed in split order by the last one): only
    with plain epilogues and K in whole tiles per split; the arrival counters are zero again after every launch,
    and the output is the same bits whichever split arrives last (run twice)."""
    gen = torch.Generator().manual_seed(5)
    k, n = 96, 40
    ops = TritonDecodeOps()
    w, x, res = _rand(n, k, dtype=torch.float32, scale=0.1, gen=gen), _rand(1, k, dtype=torch.float32, gen=gen), \
        _rand(1, n, dtype=torch.float32, gen=gen)
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", "block_k=16,split_k=2,preload=0")
    cfg = choose_config(1, n, k)
    assert ops._split_k(cfg, x, n, k, 1, None) == 2 and ops._split_k(cfg, x, n, k, 2, None) == 1  # no RoPE/KV
    assert ops._split_k(cfg._replace(split_k=4), x, n, k, 1, None) == 1  # 96 is not 4 splits of whole 16-col tiles
    assert ops._split_k(cfg._replace(preload=1), x, n, k, 1, None) == 1
    a, b = ops.linear(x, w, None, res), ops.linear(x, w, None, res)
    assert torch.equal(a, b) and not ops._split_cnt[x.device].any()
    _close(a, TorchDecodeOps().linear(x, w, None, res), torch.float32, "split-K linear")
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", "split_k=3")
    with pytest.raises(ValueError, match="split_k must be"):
        choose_config(1, n, k)


@pytest.mark.parametrize("cfg", ["block_n=4,stream=1,preload=0", "block_n=2,stream=2,preload=2"])
def test_stream_grid_full_or_balanced_same_bits(cfg, monkeypatch):
    """The persistent GEMV's grid (every slot, or the fewest programs with the same tiles each) only moves tiles
    between programs: the same bits, RMSNorm and residual epilogues alike."""
    gen = torch.Generator().manual_seed(3)
    k, n = 96, 40  # 10 or 20 tiles over 4 or 8 slots of the interpreter's 4 "SMs"
    w, x, res, nw = (_rand(n, k, dtype=torch.float32, scale=0.1, gen=gen), _rand(1, k, dtype=torch.float32, gen=gen),
                     _rand(1, n, dtype=torch.float32, gen=gen), _rand(k, dtype=torch.float32, gen=gen))
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", cfg)
    ops, got = TritonDecodeOps(), {}
    for grid in ("full", "balanced"):
        monkeypatch.setenv("HWKV_CUDA_STREAM_GRID", grid)
        got[grid] = (ops.norm_linear(x, nw, 1e-6, w, None), ops.linear(x, w, None, res))
    assert all(torch.equal(a, b) for a, b in zip(got["full"], got["balanced"]))
    _close(got["full"][1], TorchDecodeOps().linear(x, w, None, res), torch.float32, "stream linear")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_norm_logits_is_the_widened_norm_linear(m, dtype):
    """The LM head's float32 logits come from the projection itself: the same bits as its activation-dtype output
    widened (the kernel rounds first, then stores float32), and close to the torch reference's."""
    gen = torch.Generator().manual_seed(m)
    k, n = 96, 40
    w, x, nw = _rand(n, k, dtype=dtype, scale=0.1, gen=gen), _rand(m, k, dtype=dtype, gen=gen), _rand(k, dtype=dtype,
                                                                                                        gen=gen)
    ops = TritonDecodeOps()
    got = ops.norm_logits(x, nw, 1e-6, w)
    assert got.dtype == torch.float32 and torch.equal(got, ops.norm_linear(x, nw, 1e-6, w, None).float())
    _close(got, TorchDecodeOps().norm_logits(x, nw, 1e-6, w), torch.float32 if dtype == torch.float32 else dtype,
           "norm_logits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (2, 2, 32)])
@pytest.mark.parametrize("cfg", ["", "block_n=8,stream=1,preload=0", "block_n=4,stream=2,preload=1",
                                 "block_n=4,stream=1,preload=2,l2pf=2", "block_n=4,block_k=16,stream=1"])
def test_qkv_rope_and_kv_write_match_torch(heads, kv_heads, d, dtype, cfg, monkeypatch):
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", cfg)  # the tile loop, and the persistent streaming GEMV
    gen = torch.Generator().manual_seed(heads * d)
    m, k, nb, bs, max_pos = 3, 64, 4, 16, 64
    n = (heads + 2 * kv_heads) * d
    impl = TritonAttentionBackend().make_impl(heads, d, kv_heads, d**-0.5)
    w, b = _rand(n, k, dtype=dtype, scale=0.1, gen=gen), _rand(n, dtype=dtype, gen=gen)
    nw = _rand(k, dtype=dtype, gen=gen)
    h = _rand(m, k, dtype=dtype, gen=gen)
    ang = torch.arange(max_pos)[:, None] * (1.0 / 100 ** (torch.arange(0, d, 2) / d))[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    pos = torch.tensor([5, 17, 63], device=DEV)
    slots = torch.tensor([3, -1, 40], device=DEV)  # -1: padding, never written
    caches = [torch.full((nb, 2, bs, kv_heads, d), 7.0, dtype=dtype, device=DEV) for _ in range(2)]
    args = (h, nw, 1e-5, w, b, cos, sin, pos, impl)
    got = TritonDecodeOps().qkv(*args, caches[0], slots, heads, kv_heads, d)
    want = TorchDecodeOps().qkv(*args, caches[1], slots, heads, kv_heads, d)
    _close(got, want, dtype, "qkv")
    per_slot = [c.transpose(1, 2).reshape(nb * bs, -1) for c in caches]  # [slot, (k|v, head, d)]
    _close(per_slot[0][[3, 40]], per_slot[1][[3, 40]], dtype, "kv written")  # the written slots alone
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[[3, 40]] = False
    assert (per_slot[0][untouched.to(DEV)] == 7.0).all()


def test_bad_inputs_name_the_problem():
    ops = TritonDecodeOps()
    w = torch.zeros(8, 16, device=DEV)
    with pytest.raises(ValueError, match="at most 8"):
        ops.linear(torch.zeros(9, 16, device=DEV), w, None, torch.zeros(9, 8, device=DEV))
    with pytest.raises(ValueError, match=r"input must be \[tokens, 16\]"):
        ops.norm_linear(torch.zeros(2, 12, device=DEV), torch.ones(16, device=DEV), 1e-6, w, None)
    with pytest.raises(ValueError, match="residual must be"):
        ops.linear(torch.zeros(2, 16, device=DEV), w, None, torch.zeros(2, 9, device=DEV))
    # a short bias or norm weight would be read past its end by the kernel
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\) for a \[8, 16\] weight, got \(7,\)"):
        ops.linear(torch.zeros(2, 16, device=DEV), w, torch.zeros(7, device=DEV), torch.zeros(2, 8, device=DEV))
    with pytest.raises(ValueError, match=r"norm weight must have shape \(16,\) for a \[8, 16\] weight, got \(8,\)"):
        ops.norm_linear(torch.zeros(2, 16, device=DEV), torch.ones(8, device=DEV), 1e-6, w, None)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[N, K\] matrix, got shape \(128,\)"):
        ops.norm_linear(torch.zeros(2, 16, device=DEV), torch.ones(16, device=DEV), 1e-6, w.flatten(), None)
    with pytest.raises(ValueError, match=r"weight must be a contiguous \[N, K\] matrix, got shape \(16, 8\)"):
        ops.norm_linear(torch.zeros(2, 8, device=DEV), torch.ones(8, device=DEV), 1e-6, w.t(), None)
    assert ops.validate(4, 2, 15, torch.float32, torch.float32) == [
        "head_dim 15 is odd (RoPE pairs i with i + head_dim/2)"]
    assert "dtype torch.int8" in ops.validate(4, 2, 16, torch.int8, torch.int8)[0]
    assert "KV cache dtype" in ops.validate(4, 2, 16, torch.bfloat16, torch.float16)[0]
    assert ops.validate(4, 2, 16, torch.bfloat16, torch.float8_e4m3fn) == []  # fp8 KV: quantised with scales
    with pytest.raises(ValueError, match="positions must have a unit last stride"):
        pos = torch.zeros(2, 2, dtype=torch.long, device=DEV)[:, 0]
        kv = torch.zeros(1, 2, 16, 2, 16, device=DEV)
        ops.qkv(torch.zeros(2, 16, device=DEV), torch.ones(16, device=DEV), 1e-6, torch.zeros(128, 16, device=DEV),
                None, torch.ones(8, 16, device=DEV), torch.zeros(8, 16, device=DEV), pos, None, kv,
                torch.zeros(2, dtype=torch.long, device=DEV), 4, 2, 16)


def test_config_env_override(monkeypatch):
    assert choose_config(1, 2048, 2048).block_k == 2048 and choose_config(8, 2048, 8192).block_k == 512
    assert choose_config(1, 2048, 2048).preload and not choose_config(2, 128256, 2048).preload  # the rule's LM head
    # the measured one-token tiles of Llama-3-8B's shapes (tp=1 and a tp=2 rank's); more tokens keep the rule
    assert choose_config(1, 3072, 4096) == (8, 2048, 8, 3, 0, 0, 1, 0, 0, 0)
    assert choose_config(1, 4096, 2048) == (4, 1024, 4, 1, 1, 0, 1, 0, 0, 0)
    assert choose_config(2, 3072, 4096).block_n == 4
    # Llama-3.2-1B's gate_up, down and LM head: the H200 sweep's tiles (first K tile before the wait, evict-first)
    assert choose_config(1, 2048, 8192) == (4, 2048, 8, 3, 2, 0, 1, 0, 0, 0)
    assert choose_config(2, 2048, 8192).preload == 0
    # gate_up and the LM head: the persistent GEMV since session 9 (light programs, several a SM)
    assert choose_config(1, 16384, 2048) == (8, 2048, 8, 1, 0, 1, 1, 0, 4, 0)
    assert choose_config(1, 128256, 2048) == (4, 2048, 4, 1, 2, 1, 1, 0, 6, 0)
    assert choose_config(1, 3072, 2048) == (4, 2048, 4, 1, 2, 0, 1, 0, 6, 0)  # its qkv: the persistent GEMV too
    assert choose_config(1, 2048, 2048) == (4, 2048, 4, 1, 2, 1, 1, 0, 4, 0)  # and its o_proj
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", "block_n=16,num_warps=2")
    assert choose_config(1, 2048, 2048)[:3:2] == (16, 2)
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG_2048X2048", "block_n=32")  # one shape only, over the global one
    assert choose_config(1, 2048, 2048)[:3:2] == (32, 2) and choose_config(1, 4096, 2048)[:3:2] == (16, 2)
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG_2048X2048", "evict=1")  # evict-first weight loads (A/B)
    assert choose_config(1, 2048, 2048).evict == 1 and choose_config(1, 4096, 2048).evict == 0
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG_2048X2048", "maxnreg=128")  # a register cap (A/B)
    assert choose_config(1, 2048, 2048).maxnreg == 128 and choose_config(1, 4096, 2048).maxnreg == 0
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG_2048X2048", "maxnreg=256")
    with pytest.raises(ValueError, match="maxnreg must be 0"):
        choose_config(1, 2048, 2048)
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG_2048X2048", "l2pf=3")  # the persistent GEMV's L2 prefetch: 0-2
    with pytest.raises(ValueError, match="l2pf must be"):
        choose_config(1, 2048, 2048)
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG_2048X2048", "evict=2")
    with pytest.raises(ValueError, match="evict must be 0 or 1"):
        choose_config(1, 2048, 2048)
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", "block_n=6")
    monkeypatch.delenv("HWKV_CUDA_DENSE_CONFIG_2048X2048")
    with pytest.raises(ValueError, match="power of two"):
        choose_config(1, 2048, 2048)


MODEL_SHAPES = {  # (projection, N, K); the qkv bias flag (Qwen2 has one)
    "llama-1b": ([("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                  ("lm_head", 128256, 2048)], False),
    # Llama-3-8B and its rank's shard at tp=2: the one-token tiles of M1_TILES
    "llama-8b": ([("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)], False),
    "llama-8b-tp2": ([("qkv", 3072, 4096), ("o_proj", 4096, 2048), ("gate_up", 14336, 4096), ("down", 4096, 7168)],
                     False),
    "qwen-0.5b": ([("qkv", 1152, 896), ("o_proj", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864),
                   ("lm_head", 151936, 896)], True),
}


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="the production tile configs compile for a GPU only")
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_production_tiles_on_model_shapes(model, m):
    """The configs choose_config picks for the bench's models (the K loop for down, the LM
    head's, the preloaded ones), bf16, against the torch ops."""
    gen, dt, ops, ref = torch.Generator().manual_seed(m), torch.bfloat16, TritonDecodeOps(), TorchDecodeOps()
    shapes, qkv_bias = MODEL_SHAPES[model]
    for name, n, k in shapes:
        w = _rand(n, k, dtype=dt, scale=k**-0.5, gen=gen)
        k_in = 2 * k if name == "down" else k
        x, res, nw = _rand(m, k_in, dtype=dt, gen=gen), _rand(m, n, dtype=dt, gen=gen), _rand(k, dtype=dt, gen=gen)
        if name in ("o_proj",):
            _close(ops.linear(x, w, None, res), ref.linear(x, w, None, res), dt, f"{model} {name}")
        elif name == "down":
            _close(ops.silu_linear(x, w, None, res), ref.silu_linear(x, w, None, res), dt, f"{model} {name}")
        else:  # qkv's RoPE/KV epilogue is covered above; here its tile config, as norm_linear
            b = _rand(n, dtype=dt, gen=gen) if name == "qkv" and qkv_bias else None
            _close(ops.norm_linear(x, nw, 1e-5, w, b), ref.norm_linear(x, nw, 1e-5, w, b), dt, f"{model} {name}")


def _rank_sum_pair():
    """Two ranks' fused all-reduce state on this device (a CudaAllReduce's fused buffers: each rank's
    peer table holds both buffers, so rank r's GEMV pushes into the other's slot)."""
    from types import SimpleNamespace

    from hwkv_cuda.allreduce import FUSED_SITES, FUSED_SLOT

    data = FUSED_SITES * 2 * FUSED_SLOT
    bufs = [torch.zeros(data + 3 * FUSED_SITES * 8, dtype=torch.uint8, device=DEV) for _ in range(2)]
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=DEV)
    err = torch.zeros(1, dtype=torch.int32, device=DEV)
    return [SimpleNamespace(rank=r, world_size=2, fused=True, fbuf=bufs[r], fpeers=peers, error=err,
                            fcnt=bufs[r][data:].view(torch.int64), fcnt_off=data // 8) for r in range(2)]


@pytest.mark.parametrize("cfg", ["", "block_k=32", "block_k=32,preload=2"])  # the norm in one tile, over three
def test_rank_sum_in_the_gemvs_two_ranks(cfg, monkeypatch):
    """The row-parallel all-reduce inside the GEMVs (TritonRankSum) for two ranks on one device: each
    rank's producer runs first (they only push), then each consumer, so nothing waits. Every rank holds
    the same bits, equal to the sum in rank order, rounded, plus the residual, rounded; the consumer's
    output is the plain op's on that h; every counter is back at zero after each call."""
    from types import SimpleNamespace

    from hwkv_cuda.decode_ops import TritonRankSum

    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", cfg)
    dtype, gen = torch.float32, torch.Generator().manual_seed(7)
    m, hidden, q, inter = 3, 96, 40, 72
    ops = TritonDecodeOps()
    reds = [TritonRankSum(ops, ar) for ar in _rank_sum_pair()]
    wo = [_rand(hidden, q // 2, dtype=dtype, scale=0.1, gen=gen) for _ in range(2)]  # o_proj's column shards
    wd = [_rand(hidden, inter // 2, dtype=dtype, scale=0.1, gen=gen) for _ in range(2)]
    wgu, nw = _rand(inter, hidden, dtype=dtype, scale=0.1, gen=gen), _rand(hidden, dtype=dtype, gen=gen)
    h = _rand(m, hidden, dtype=dtype, gen=gen)
    for _ in range(2):  # both sites, each used twice
        xs = [_rand(m, q // 2, dtype=dtype, gen=gen) for _ in range(2)]
        pend = [reds[r].linear(xs[r], wo[r], None) for r in range(2)]
        parts = [p.partial for p in pend]
        assert torch.equal(parts[0], xs[0] @ wo[0].T) or torch.allclose(parts[0], xs[0] @ wo[0].T, atol=1e-5)
        got = [reds[r].norm_linear(pend[r], h, nw, 1e-6, wgu, None) for r in range(2)]
        want_h = (parts[0] + parts[1]) + h
        assert torch.equal(got[0][1], got[1][1]) and torch.equal(got[0][1], want_h)
        assert torch.equal(got[0][0], got[1][0])
        assert torch.equal(got[0][0], ops.norm_linear(want_h, nw, 1e-6, wgu, None))
        h = got[0][1]
        gu = [_rand(m, inter, dtype=dtype, gen=gen) for _ in range(2)]  # [gate | up] halves of this rank
        pend = [reds[r].silu_linear(gu[r], wd[r], None) for r in range(2)]
        out = [reds[r].sum(pend[r], h) for r in range(2)]
        assert torch.equal(out[0], out[1]) and torch.equal(out[0], (pend[0].partial + pend[1].partial) + h)
        h = out[0]
        for red in reds:
            assert red.ar.fcnt.tolist() == [0] * 6
    assert int(reds[0].ar.error.item()) == 0
    # a consumer whose peer never pushed gives up (bounded) and says so, instead of hanging
    if DEV == "cpu":
        import hwkv_cuda.kernels.dense as dense

        monkeypatch.setattr(dense, "MAX_SPIN", 4)
        late = SimpleNamespace(partial=parts[0], site=0, programs=5)
        reds[0].sum(late, h)
        assert int(reds[0].ar.error.item()) == 1


def _argmax_rows_case(v, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, v, generator=g)
    x[1, 5] = x[1, v - 3] = x[1].max() + 1  # a tie across programs: the first wins
    x[2, 700:702] = 50.0  # a tie inside one program
    x[3] = float("-inf")  # every token masked
    x[4, 9000 % v] = x[4, 9000 % v + 1] = float("nan")  # NaN is the maximum, the first one
    x[5] = x[5].round()  # many ties
    x[6] = -1.0
    x[6, v // 2] = 0.0
    x[6, 3] = -0.0  # -0.0 == 0.0: the first of them
    return x


@pytest.mark.parametrize("v", [128256, 50257, 4096, 1000])
def test_argmax_is_torch_argmax(v, monkeypatch):
    """The one-launch greedy argmax: the index torch's argmax gives (ties, NaN, -inf rows, signed zeros, a vocab that
    is not a multiple of the program's block), twice (the slots and counters come back empty), and not offered
    where it does not apply."""
    monkeypatch.delenv("HWKV_CUDA_ARGMAX", raising=False)  # offered by default
    ops = TritonDecodeOps()
    x = _argmax_rows_case(v, v).to(DEV)
    for _ in range(2):
        got = ops.argmax(x)
        assert got is not None and got.dtype == torch.int64 and torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert torch.equal(ops.argmax(x[3:5]), x[3:5].argmax(-1))  # a view of rows (offset start)
    ((keys, counts),) = ops._argmax_bufs.values()
    assert bool((keys == -(1 << 63)).all()) and int(counts.count_nonzero()) == 0
    assert ops.argmax(x.to(torch.bfloat16)) is None and ops.argmax(x.t()) is None
    assert ops.argmax(x[:1].expand(ops.ARGMAX_MAX_ROWS + 1, v).contiguous()) is None  # more rows than ARGMAX_MAX_ROWS
    monkeypatch.setenv("HWKV_CUDA_ARGMAX", "0")
    assert ops.argmax(x) is None


STREAM_COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from hwkv_cuda.kernels.dense import dense_kernel_stream as k

vals = dict(PROLOGUE=1, EPILOGUE=2, HAS_BIAS=False, M_PAD=1, BLOCK_N=4, BLOCK_K=4096, HEAD=128, Q_N=2048, KV_N=512,
            BS=16, PDL=True, PRE=2, EVICT=0, scale_ptr=None, stride_scale=0, KV_FP8=False, STAGES=1, L2PF=1,
            CHUNKED=False)
sig = {}
for p in k.params:
    n = p.name
    if p.is_constexpr or n in ("scale_ptr", "stride_scale"):
        sig[n] = "constexpr"
    elif n in ("pos_ptr", "slot_ptr"):
        sig[n] = "*i64"
    elif n.endswith("_ptr"):
        sig[n] = "*bf16"
    else:
        sig[n] = "fp32" if n == "eps" else "i32"
for l2pf, epi in ((1, 2), (2, 0), (1, 1)):
    compile(ASTSource(k, sig, dict(vals, L2PF=l2pf, EPILOGUE=epi)), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_stream_l2_prefetch_compiles_for_sm90():
    """The persistent GEMV's bulk L2 prefetches (inline PTX, never run by the interpreter) compile for sm_90: the
    first tile before the PDL wait (l2pf=1) and the next one every iteration (2), RoPE / residual / plain epilogues."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", STREAM_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "compiled" in p.stdout, p.stderr[-3000:]


# one-token tiles of tp=1's Llama-3.2-1B and Llama-3-8B shapes as of session 10: a tp=2 rank's tiles (other M1_TILES
# keys) must leave them as they are (the per-rank A/Bs run on a rank's shapes alone)
TP1_TILES = {
    (3072, 2048): (4, 2048, 4, 1, 2, 0, 1, 0, 6, 0), (2048, 2048): (4, 2048, 4, 1, 2, 1, 1, 0, 4, 0),
    (16384, 2048): (8, 2048, 8, 1, 0, 1, 1, 0, 4, 0), (2048, 8192): (4, 2048, 8, 3, 2, 0, 1, 0, 0, 0),
    (128256, 2048): (4, 2048, 4, 1, 2, 1, 1, 0, 6, 0), (6144, 4096): (8, 2048, 8, 3, 0, 0, 1, 0, 0, 0),
    (4096, 4096): (4, 1024, 4, 1, 1, 0, 1, 0, 0, 0), (28672, 4096): (8, 2048, 8, 3, 0, 0, 1, 0, 0, 0),
    (4096, 14336): (8, 2048, 8, 3, 0, 0, 1, 0, 0, 0), (128256, 4096): (4, 2048, 8, 3, 0, 0, 1, 0, 0, 0),
}


def test_tp1_one_token_tiles_unchanged(monkeypatch):
    for k in [k for k in os.environ if k.startswith("HWKV_CUDA_DENSE_CONFIG")]:
        monkeypatch.delenv(k)
    assert {nk: tuple(choose_config(1, *nk)) for nk in TP1_TILES} == TP1_TILES

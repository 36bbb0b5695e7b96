"""The push all-reduce kernels (plain, residual add, residual add + RMSNorm) for two ranks, on one
device: rank 1's push into rank 0's buffer is done by hand first (its slot and flags), then rank 0's
kernel and rank 1's run one after the other, so neither waits. Runs on CPU in Triton's interpreter
(conftest) and on a GPU alike; two-GPU runs are ``hwkv bench allreduce``. Every rank must hold the
same bits: the sum in rank order in float32, rounded once, then the add and the norm as the model."""

from __future__ import annotations

import pytest
import torch

from hwkv.model.layers import add_rms_norm

REGION = 4096
# Triton's CPU interpreter rounds float32 -> bfloat16 differently from the GPU (round to nearest even,
# as torch): bit-exact on a GPU and in float32, one bfloat16 step apart in the interpreter
EXACT_BF16 = torch.cuda.is_available()


def _check(got, want, scale):
    """Bit-exact, except bfloat16 in the interpreter: within two bfloat16 steps of ``scale`` (the
    largest intermediate's magnitude, elementwise: a step of the partial sum survives a cancelling add)."""
    if EXACT_BF16 or got.dtype == torch.float32:
        assert torch.equal(got, want)
    else:
        assert bool(((got.float() - want.float()).abs() <= 2 ** -7 * scale.float().abs() + 1e-6).all())


def _ranks(dev, slot_elems: int, programs: int, dtype):
    """Two ranks' buffers ([2 parities][2 slots][slot_elems] then [programs][2] int64 flags)."""
    esize = torch.empty((), dtype=dtype).element_size()
    data = 2 * 2 * slot_elems * esize
    bufs = [torch.zeros(data + programs * 2 * 8, dtype=torch.uint8, device=dev) for _ in range(2)]
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
    epochs = [torch.zeros(programs, dtype=torch.int64, device=dev) for _ in range(2)]
    return bufs, peers, epochs, data


def _prepush(bufs, data, slot_elems, programs, dtype, x1, call):
    """What rank 1's kernel would do to rank 0's buffer at call ``call`` (epoch ``call``)."""
    base = (call % 2) * 2 * slot_elems
    view = bufs[0][:data].view(dtype)
    n = x1.numel()
    view[base + slot_elems: base + slot_elems + n] = x1.view(-1)
    flags = bufs[0][data:].view(torch.int64).view(programs, 2)
    flags[:, 1] = call


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual", [False, True])
def test_push_all_reduce_two_ranks(dtype, residual):
    from hwkv_cuda.kernels.allreduce import push_all_reduce_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    esize = torch.empty((), dtype=dtype).element_size()
    block = REGION // esize
    n = 3 * block + 17  # a ragged last program
    programs = -(-n // block)
    slot = programs * block
    bufs, peers, epochs, data = _ranks(dev, slot, programs, dtype)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(0)
    for call in (1, 2, 3):  # both parities, epochs advancing
        xs = [torch.randn(n, generator=g).to(dtype).to(dev) for _ in range(2)]
        res = torch.randn(n, generator=g).to(dtype).to(dev)
        want = (xs[0].float() + xs[1].float()).to(dtype)
        if residual:
            want = (want.float() + res.float()).to(dtype)
        _prepush(bufs, data, slot, programs, dtype, xs[1], call)
        outs = []
        for rank in (0, 1):
            x = xs[rank].clone()
            out = torch.empty_like(x) if residual else x
            push_all_reduce_kernel[(programs,)](
                x, res if residual else x, out, bufs[rank][:data].view(dtype), bufs[rank][data:].view(torch.int64),
                peers, epochs[rank], err, n, RANK=rank, WS=2, SLOT=slot, FLAG_OFF=data // 8, BLOCK=block,
                HAS_RES=residual)
            outs.append(out)
        assert int(err.item()) == 0
        assert torch.equal(outs[0], outs[1])  # every rank the same bits
        _check(outs[0], want, (xs[0].float().abs() + xs[1].float().abs() + res.float().abs()) * 2)
        assert epochs[0].tolist() == [call] * programs == epochs[1].tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_push_all_reduce_add_rms_norm_two_ranks(dtype):
    from hwkv_cuda.kernels.allreduce import push_all_reduce_norm_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows, hidden, eps = 3, 256, 1e-5
    slot = rows * hidden  # the kernel's SLOT: norm_max // element size; rows of one hidden size
    bufs, peers, epochs, data = _ranks(dev, slot, rows, dtype)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(hidden, generator=g).to(dtype).to(dev)
    for call in (1, 2):
        xs = [torch.randn(rows, hidden, generator=g).to(dtype).to(dev) for _ in range(2)]
        res = torch.randn(rows, hidden, generator=g).to(dtype).to(dev)
        summed = (xs[0].float() + xs[1].float()).to(dtype)
        want_out, want_h = add_rms_norm(summed, res.clone(), w, eps)
        _prepush(bufs, data, slot, rows, dtype, xs[1], call)
        got = []
        for rank in (0, 1):
            out, h = torch.empty_like(res), torch.empty_like(res)
            push_all_reduce_norm_kernel[(rows,)](
                xs[rank], res, w, out, h, bufs[rank][:data].view(dtype), bufs[rank][data:].view(torch.int64), peers,
                epochs[rank], err, hidden, eps, RANK=rank, WS=2, SLOT=slot, FLAG_OFF=data // 8, BLOCK=hidden)
            got.append((out, h))
        assert int(err.item()) == 0
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
        scale = xs[0].float().abs() + xs[1].float().abs() + res.float().abs()
        _check(got[0][1], want_h, 2 * scale)
        # the normalised row: its sum of squares is a reduction in the kernel's order, not torch's
        # (a float32 ulp apart on the H200 at ed3398d), so it is held to a few ulps of its magnitude;
        # the sum and h above stay bit-exact, and every rank's bits the same
        rms = want_h.float().pow(2).mean(-1, keepdim=True).sqrt()
        if dtype == torch.float32:
            off = (got[0][0] - want_out).abs()
            assert bool((off <= 2**-20 * (want_out.abs() + w.abs())).all())
        else:
            _check(got[0][0], want_out, 4 * (scale / rms + 1) * w.float().abs())


def _ll_words(x: torch.Tensor, epoch: int) -> torch.Tensor:
    """The low-latency push's int64 words of ``x`` (16-bit): elements 2i and 2i + 1 in the low 32 bits, the epoch
    in the high 32."""
    b = x.view(torch.int16).to(torch.int64) & 0xFFFF
    return b[0::2] | (b[1::2] << 16) | ((epoch & 0xFFFFFFFF) << 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
def test_push_ll_two_ranks(dtype, residual):
    """The low-latency push: rank 1's words put into rank 0's buffer by hand, rank 0's kernel (which writes its own
    into rank 1's buffer), then rank 1's; over three calls (both parities; a slot's old words carry the old epoch)
    the same bits on both ranks as the push kernel's sum."""
    from hwkv_cuda.kernels.allreduce import push_ll_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = REGION // 2
    n = 2 * block + 6  # a ragged last program
    programs = -(-n // block)
    slot_w = programs * block // 2
    bufs = [torch.zeros(2 * 2 * slot_w, dtype=torch.int64, device=dev) for _ in range(2)]
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
    epochs = [torch.zeros(programs, dtype=torch.int64, device=dev) for _ in range(2)]
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(2)
    for call in (1, 2, 3):
        xs = [torch.randn(n, generator=g).to(dtype).to(dev) for _ in range(2)]
        res = torch.randn(n, generator=g).to(dtype).to(dev)
        want = (xs[0].float() + xs[1].float()).to(dtype)
        if residual:
            want = (want.float() + res.float()).to(dtype)
        padded = torch.zeros(programs * block, dtype=dtype, device=dev)
        padded[:n] = xs[1]
        base = (call % 2) * 2 * slot_w
        bufs[0][base + slot_w: base + 2 * slot_w] = _ll_words(padded, call)  # rank 1's push into rank 0
        outs = []
        for rank in (0, 1):
            x = xs[rank].clone()
            out = torch.empty_like(x) if residual else x
            push_ll_kernel[(programs,)](x, res if residual else x, out, bufs[rank], peers, epochs[rank], err, n,
                                        RANK=rank, WS=2, SLOT_W=slot_w, BLOCK=block, HAS_RES=residual)
            outs.append(out)
        assert int(err.item()) == 0
        assert torch.equal(outs[0], outs[1])
        _check(outs[0], want, (xs[0].float().abs() + xs[1].float().abs() + res.float().abs()) * 2)
        assert epochs[0].tolist() == [call] * programs == epochs[1].tolist()
        # rank 0's words in rank 1's buffer: its elements, this call's epoch, padding zeros
        padded[:n] = xs[0]
        assert torch.equal(bufs[1][base: base + slot_w], _ll_words(padded, call))


def test_push_ll_gather_two_ranks():
    """The low-latency all-gather of [R, S] rows (a ragged last program, S not a multiple of a program's block): rank
    1's words into rank 0's buffer by hand, rank 0's kernel, then rank 1's; both parities; every rank the same bytes,
    the parts side by side in rank order."""
    from hwkv_cuda.kernels.allreduce import push_ll_gather_kernel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = REGION // 2
    rows, s = 2, 1500
    n = rows * s
    programs = -(-n // block)
    slot_w = programs * block // 2
    bufs = [torch.zeros(2 * 2 * slot_w, dtype=torch.int64, device=dev) for _ in range(2)]
    peers = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=dev)
    epochs = [torch.zeros(programs, dtype=torch.int64, device=dev) for _ in range(2)]
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    g = torch.Generator().manual_seed(3)
    for call in (1, 2, 3):
        xs = [torch.randn(rows, s, generator=g).to(torch.bfloat16).to(dev) for _ in range(2)]
        padded = torch.zeros(programs * block, dtype=torch.bfloat16, device=dev)
        padded[:n] = xs[1].reshape(-1)
        base = (call % 2) * 2 * slot_w
        bufs[0][base + slot_w: base + 2 * slot_w] = _ll_words(padded, call)
        outs = []
        for rank in (0, 1):
            out = torch.full((rows, 2 * s), float("nan"), dtype=torch.bfloat16, device=dev)
            push_ll_gather_kernel[(programs,)](xs[rank], out, bufs[rank], peers, epochs[rank], err, n, s, RANK=rank,
                                               WS=2, SLOT_W=slot_w, BLOCK=block)
            outs.append(out)
        assert int(err.item()) == 0
        assert torch.equal(outs[0], torch.cat(xs, dim=1)) and torch.equal(outs[1], outs[0])
        assert epochs[0].tolist() == [call] * programs == epochs[1].tolist()


COMPILE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from hwkv_cuda.kernels import allreduce as k

common = dict(flags_ptr="*i64", peers_ptr="*i64", epochs_ptr="*i64", err_ptr="*i32", RANK="constexpr",
              WS="constexpr", SLOT="constexpr", FLAG_OFF="constexpr", BLOCK="constexpr")
for dt in ("bf16", "fp32"):
    p = f"*{dt}"
    sig = dict(x_ptr=p, res_ptr=p, out_ptr=p, buf_ptr=p, n="i32", HAS_RES="constexpr", PDL="constexpr", **common)
    for res, pdl in ((False, False), (True, False), (True, True)):
        compile(ASTSource(k.push_all_reduce_kernel, sig, dict(RANK=1, WS=2, SLOT=4096, FLAG_OFF=64, BLOCK=2048,
                                                              HAS_RES=res, PDL=pdl)), target=GPUTarget("cuda", 90, 32))
    sig = dict(x_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, h_ptr=p, buf_ptr=p, H="i32", eps="fp32", PDL="constexpr",
               **common)
    for pdl in (False, True):
        compile(ASTSource(k.push_all_reduce_norm_kernel, sig, dict(RANK=0, WS=2, SLOT=8192, FLAG_OFF=64, BLOCK=4096,
                                                                   PDL=pdl)), target=GPUTarget("cuda", 90, 32))
for dt in ("bf16", "fp16"):
    p = f"*{dt}"
    sig = dict(x_ptr=p, res_ptr=p, out_ptr=p, buf_ptr="*i64", peers_ptr="*i64", epochs_ptr="*i64", err_ptr="*i32",
               n="i32", RANK="constexpr", WS="constexpr", SLOT_W="constexpr", BLOCK="constexpr", HAS_RES="constexpr",
               PDL="constexpr")
    for res, pdl in ((False, False), (True, True)):
        compile(ASTSource(k.push_ll_kernel, sig, dict(RANK=1, WS=2, SLOT_W=16384, BLOCK=2048, HAS_RES=res, PDL=pdl)),
                target=GPUTarget("cuda", 90, 32))
for dt in ("bf16", "fp32"):  # the copy-engine all-reduce's sum and its fallback flag kernels
    sig = dict(x_ptr=f"*{dt}", slot_ptr=f"*{dt}", out_ptr=f"*{dt}", n="i64", stride="i64", RANK="constexpr",
               WS="constexpr", BLOCK="constexpr")
    for has_out in (False, True):
        compile(ASTSource(k.ce_sum_kernel, {**sig, "HAS_OUT": "constexpr"}, dict(RANK=1, WS=2, BLOCK=4096,
                                                                               HAS_OUT=has_out)),
                target=GPUTarget("cuda", 90, 32))
    p = f"*{dt}"
    sig = dict(x_ptr=p, slot_ptr=p, res_ptr=p, w_ptr=p, out_ptr=p, h_ptr=p, H="i32", eps="fp32", stride="i64",
               RANK="constexpr", WS="constexpr", BLOCK="constexpr")
    compile(ASTSource(k.ce_add_norm_kernel, sig, dict(RANK=0, WS=2, BLOCK=4096)), target=GPUTarget("cuda", 90, 32))
compile(ASTSource(k.ce_signal_kernel, dict(addr="i64", value="i64"), {}), target=GPUTarget("cuda", 90, 32))
compile(ASTSource(k.ce_wait_kernel, dict(addr="i64", value="i64"), {}), target=GPUTarget("cuda", 90, 32))
sig = dict(x_ptr="*bf16", out_ptr="*bf16", buf_ptr="*i64", peers_ptr="*i64", epochs_ptr="*i64", err_ptr="*i32",
           n="i32", S="i32", RANK="constexpr", WS="constexpr", SLOT_W="constexpr", BLOCK="constexpr", PDL="constexpr")
compile(ASTSource(k.push_ll_gather_kernel, sig, dict(RANK=0, WS=2, SLOT_W=65536, BLOCK=2048, PDL=True)),
        target=GPUTarget("cuda", 90, 32))
from hwkv_cuda.kernels import dense as d  # the all-reduce inside the decode GEMVs (push epilogue, rank-sum prologue)

ptrs = ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "res_ptr", "nw_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "kv_ptr", "slot_ptr")
ints = ("M", "N", "K", "num_slots", "stride_xm", "stride_ym", "stride_rm", "stride_cos", "stride_blk", "stride_kv",
        "stride_tok", "stride_head")
consts = ("PROLOGUE", "EPILOGUE", "HAS_BIAS", "M_PAD", "BLOCK_N", "BLOCK_K", "HEAD", "Q_N", "KV_N", "BS", "PDL",
          "PRELOAD", "ONE_TILE", "KV_FP8", "RANK", "WS", "RS", "SLOT", "CNT_OFF", "EVICT", "SPLIT_K")
for prologue, epilogue, rs, one, pre, sk in ((0, 3, 0, True, 0, 1), (2, 3, 0, False, 0, 1), (1, 0, 2, False, 2, 1),
                                            (1, 2, 2, True, 0, 1), (1, 2, 2, False, 2, 1), (2, 3, 0, False, 2, 1),
                                            (0, 0, 0, False, 0, 4)):
    sig = {**{n: "*bf16" for n in ptrs}, "pos_ptr": "*i64", "slot_ptr": "*i64", **{n: "i32" for n in ints},
           "eps": "fp32", "scale_ptr": "constexpr", "stride_scale": "constexpr", "buf_ptr": "*bf16",
           "peers_ptr": "*i64", "cnt_ptr": "*i64", "err_ptr": "*i32", "hres_ptr": "*bf16", "hout_ptr": "*bf16",
           "stride_hm": "i32", "site": "i32", "expect": "i32", "part_ptr": "*fp32", "sk_cnt_ptr": "*i32",
           **{n: "constexpr" for n in consts}}
    vals = dict(PROLOGUE=prologue, EPILOGUE=epilogue, HAS_BIAS=False, M_PAD=1, BLOCK_N=8, BLOCK_K=2048, HEAD=128,
                Q_N=2048, KV_N=512, BS=16, PDL=True, PRELOAD=pre, ONE_TILE=one, KV_FP8=False, RANK=1, WS=2, RS=rs,
                SLOT=65536, CNT_OFF=64, scale_ptr=None, stride_scale=0, EVICT=int(sk > 1), SPLIT_K=sk)
    compile(ASTSource(d.dense_kernel, sig, vals), target=GPUTarget("cuda", 90, 32))
sig = dict(x_ptr="*bf16", buf_ptr="*bf16", hres_ptr="*bf16", hout_ptr="*bf16", cnt_ptr="*i64", err_ptr="*i32",
           n="i32", K="i32", site="i32", expect="i32", RANK="constexpr", RS="constexpr", SLOT="constexpr",
           BLOCK="constexpr", PDL="constexpr")
compile(ASTSource(d.rank_sum_kernel, sig, dict(RANK=0, RS=2, SLOT=65536, BLOCK=1024, PDL=True)),
        target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_push_kernels_compile_for_sm90():
    """The interpreter runs what the compiler refuses (a plain global read inside @jit did, and the
    first GPU run failed on it): compile every kernel to PTX for an H100 / H200, no GPU needed."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "compiled" in p.stdout, p.stderr[-3000:]


def _one_rank(monkeypatch, ll_max=0):
    """A one-rank CudaAllReduce on this device (its peer table: its own buffer), for the self-test."""
    from hwkv_cuda.allreduce import CudaAllReduce

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ar = CudaAllReduce.__new__(CudaAllReduce)
    ar.rank, ar.world_size, ar.device, ar._bufs = 0, 1, dev, []
    ar.push_max, ar.norm_max, ar._norm_key, ar.ll_max = 16 * 1024, 4 * 1024, None, ll_max

    def peer_buffer(nbytes, tag):
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
        ar._bufs.append(buf)
        return buf, torch.tensor([buf.data_ptr()], dtype=torch.int64, device=dev)

    monkeypatch.setattr(ar, "_peer_buffer", peer_buffer)
    ar._setup_push()
    return ar


def test_self_test_passes_and_names_a_broken_path(monkeypatch):
    ar = _one_rank(monkeypatch)
    ar._self_test()
    assert ar._norm_key is None  # the model's first call fixes the hidden size, not the self-test
    assert ar.epochs.tolist()[:3] == [2, 2, 2]  # plain and residual calls: every program advanced
    push = ar._push
    monkeypatch.setattr(ar, "_push", lambda t, residual: push(t, None))  # a kernel that drops the residual
    with pytest.raises(RuntimeError, match=r"self-test failed on rank 0: push \+ residual$"):
        ar._self_test()


def test_ll_self_test_passes_and_names_a_broken_path(monkeypatch):
    ar = _one_rank(monkeypatch, ll_max=16 * 1024)
    ar._self_test_ll()
    assert ar.lepochs.tolist()[:2] == [4, 4] and int(ar.error.item()) == 0  # 2 dtypes x (plain, residual)
    assert ar.gepochs.tolist()[:2] == [2, 2]  # the gather: 2 dtypes
    push = ar._push
    monkeypatch.setattr(ar, "_push", lambda t, residual, ll=None: push(t, None, ll))  # drops the residual
    with pytest.raises(RuntimeError, match=r"push self-test failed on rank 0: torch.bfloat16 push \+ residual, "):
        ar._self_test_ll()


def test_fused_self_test_passes_and_names_a_broken_path(monkeypatch):
    """The all-reduce inside the decode GEMVs checks itself at setup (one rank here: no peer to wait
    for, the same kernels); a consumer that drops the residual is named."""
    from hwkv_cuda.allreduce import CudaAllReduce
    from hwkv_cuda.decode_ops import TritonRankSum

    monkeypatch.setattr(CudaAllReduce, "fused", True)
    ar = _one_rank(monkeypatch)
    ar._self_test_fused()
    assert ar.fcnt.tolist() == [0] * 6 and int(ar.error.item()) == 0
    total = TritonRankSum.sum
    monkeypatch.setattr(TritonRankSum, "sum", lambda self, s, h: total(self, s, torch.zeros_like(h)))
    with pytest.raises(RuntimeError, match=r"fused all-reduce self-test failed on rank 0: sum$"):
        ar._self_test_fused()

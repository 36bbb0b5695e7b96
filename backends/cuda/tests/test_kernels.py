"""Interpreter-mode (CPU) checks of the Triton kernels against an independent naive attention."""

import pytest
import torch

pytest.importorskip("triton")

import hwkv_cuda.attention as cuda_attn  # noqa: E402
from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from naive import naive_attention  # noqa: E402

from hwkv.interfaces.attention import AttentionMetadata  # noqa: E402
from hwkv.testing.paged import random_block_tables  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(qlens, slens, heads, kv_heads, head_size, bs, seed):
    g = torch.Generator().manual_seed(seed)
    tables, nb = random_block_tables(slens, bs, g)  # scattered physical blocks
    kv = torch.randn(nb, 2, bs, kv_heads, head_size, generator=g)
    q = torch.randn(sum(qlens), heads, head_size, generator=g)
    md = AttentionMetadata.build(qlens, slens, tables, bs, device=DEV)
    return q, kv, md, tables


CASES = {  # name: (query lens, seq lens, H, H_kv, D, block size)
    "prefill_no_cache_mqa": ([17, 5], [17, 5], 4, 1, 32, 16),
    "prefill_on_prefix_gqa4": ([9, 20], [40, 70], 8, 2, 32, 32),
    "decode_mha_split": ([1, 1, 1], [5, 100, 700], 4, 4, 16, 16),
    "mixed_gqa4_split": ([1, 12, 1, 30], [50, 12, 300, 90], 8, 2, 16, 16),
    "decode_head64_block32": ([1, 1], [33, 64], 4, 2, 64, 32),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_naive(name, monkeypatch):
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=32,split_below=1000,part_cap=0")  # split on small shapes
    qlens, slens, h, hkv, d, bs = CASES[name]
    q, kv, md, tables = _case(qlens, slens, h, hkv, d, bs, seed=len(name))
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    built = TritonAttentionBackend().metadata_builder().build(md)
    out = torch.full_like(q, float("nan"), device=DEV)  # poisoned: every element must be written
    impl.forward_into(out, q.to(DEV), kv.to(DEV), built)
    ref = naive_attention(q, kv, qlens, slens, tables, d**-0.5)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert not out.isnan().any()
    assert err < 1e-5, f"{name}: rel err {err:.2e}"
    splits = {p[1] for p in built.plans.values()}
    if "split" in name:
        assert max(splits) > 1, "case meant to exercise split-KV ran unsplit"


def test_split_heuristic():
    def splits(qlens, slens, block_q=1):
        tables = [list(range(-(-max(slens) // 16)))] * len(slens)
        md = cuda_attn.CudaAttentionMetadata(AttentionMetadata.build(qlens, slens, tables, 16), 132)
        return md.plan(block_q, 64, 32, 8, 128, 2)[1]

    assert splits([1], [16384]) > 8  # one long decode: flash-decoding
    assert splits([1] * 256, [1024] * 256) == 1  # a big batch already fills the SMs
    assert splits([512], [4608], block_q=32) == 1  # fp32 partials of 512 queries would outweigh the KV


def test_host_bounds_above_device_lengths(monkeypatch):
    """What a CUDA-graph capture does: host lengths at an upper bound (more splits, a wider grid)
    while the device holds the real lengths; surplus splits and q blocks must contribute nothing."""
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=16")
    qlens, slens, h, hkv, d, bs = [1, 1, 1, 1], [6, 18, 40, 4], 4, 2, 32, 16
    q, kv, md, tables = _case(qlens, slens, h, hkv, d, bs, seed=3)
    width = md.block_tables.shape[1]
    bound = AttentionMetadata.build(qlens, [width * bs] * 4, torch.zeros(4, width, dtype=torch.int32), bs, DEV)
    bound.seq_lens, bound.block_tables, bound.slot_mapping = md.seq_lens, md.block_tables, md.slot_mapping
    built = cuda_attn.CudaAttentionMetadata(bound, 132)
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    out = torch.full_like(q, float("nan"), device=DEV)
    impl.forward_into(out, q.to(DEV), kv.to(DEV), built)
    assert max(p[1] for p in built.plans.values()) > 1
    ref = naive_attention(q, kv, qlens, slens, tables, d**-0.5)
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("bs", [16, 32])
def test_write_kv_skips_padding(bs):
    g = torch.Generator().manual_seed(bs)
    nb, hkv, d, n = 4, 2, 32, 6
    qkv = torch.randn(n, 4 + 2 * hkv, d, generator=g)  # strided key/value views, as a fused QKV gives them
    key, value = qkv[:, 4:4 + hkv], qkv[:, 4 + hkv:]
    slots = torch.tensor([0, bs + 3, -1, 3 * bs - 1, -1, 2], dtype=torch.int64)
    kv = torch.full((nb, 2, bs, hkv, d), 7.0)
    impl = TritonAttentionBackend().make_impl(4, d, hkv, 1.0)
    kv_dev = kv.to(DEV)
    impl.write_kv(key.to(DEV), value.to(DEV), kv_dev, slots.to(DEV))
    exp = kv.clone()
    flat = exp.transpose(1, 2).reshape(nb * bs, 2, hkv, d)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            flat[s, 0], flat[s, 1] = key[t], value[t]
    exp = flat.reshape(nb, bs, 2, hkv, d).transpose(1, 2)
    assert torch.equal(kv_dev.cpu(), exp)


def test_copy_blocks_kernel():
    from hwkv_cuda.kernels.cache import copy_blocks_kernel

    src = torch.randn(5, 2, 16, 2, 8).to(DEV)
    dst = torch.zeros_like(src)
    pairs = torch.tensor([[0, 4], [3, 1], [4, 0]], dtype=torch.int64, device=DEV)
    elems = src[0].numel()
    copy_blocks_kernel[(3, -(-elems // 256))](src.view(torch.int32), dst.view(torch.int32), pairs, elems, CHUNK=256)
    for s, d in pairs.tolist():
        assert torch.equal(dst[d], src[s])
    assert dst[2].abs().sum() == 0 and dst[3].abs().sum() == 0


def test_bad_inputs_name_the_field():
    impl = TritonAttentionBackend().make_impl(4, 16, 2, 0.25)
    kv = torch.zeros(2, 2, 16, 2, 16)
    with pytest.raises(ValueError, match="num_heads 4 must be a multiple"):
        TritonAttentionBackend().make_impl(4, 16, 3, 0.25)
    with pytest.raises(ValueError, match="layer_kv"):
        impl.write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), kv[:, 0], torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_mapping has 2"):
        impl.write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), kv, torch.zeros(2, dtype=torch.int64))
    md = AttentionMetadata.build([1], [3], [[0]], 32)
    with pytest.raises(ValueError, match="block size 16 differs"):
        impl.forward(torch.zeros(1, 4, 16), None, None, kv, md)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_after_metadata_is_gone():
    """The engine captures with throw-away metadata: the graph may read only the caller's tensors."""
    qlens, slens, h, hkv, d, bs = [1] * 4, [300, 1000, 17, 4000], 32, 8, 128, 16
    q, kv, md, tables = _case(qlens, slens, h, hkv, d, bs, seed=5)
    q, kv = q.to("cuda", torch.bfloat16), kv.to("cuda", torch.bfloat16)
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    out = torch.empty_like(q)
    built = TritonAttentionBackend().metadata_builder().build(md)
    impl.forward_into(out, q, kv, built)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        impl.forward_into(out, q, kv, built)
    del built
    junk = [torch.full((1 << 16,), 7, dtype=torch.int32, device="cuda") for _ in range(8)]  # reuse freed memory
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = naive_attention(q.cpu(), kv.cpu(), qlens, slens, tables, d**-0.5)
    assert (out.cpu().double() - ref).norm() / ref.norm() < 1e-2 and len(junk) == 8

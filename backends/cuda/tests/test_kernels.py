"""Interpreter-mode (CPU) checks of the Triton kernels against an independent naive attention."""

import pytest
import torch

pytest.importorskip("triton")

import hwkv_cuda.attention as cuda_attn  # noqa: E402
from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from naive import naive_attention, paged_case  # noqa: E402

from hwkv.interfaces.attention import AttentionMetadata  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(qlens, slens, heads, kv_heads, head_size, bs, seed):
    return paged_case(qlens, slens, heads, kv_heads, head_size, bs, seed, DEV)


CASES = {  # name: (query lens, seq lens, H, H_kv, D, block size)
    "prefill_no_cache_mqa": ([17, 5], [17, 5], 4, 1, 32, 16),
    "prefill_on_prefix_gqa4": ([9, 20], [40, 70], 8, 2, 32, 32),
    "decode_mha_split": ([1, 1, 1], [5, 100, 700], 4, 4, 16, 16),
    "mixed_gqa4_split": ([1, 12, 1, 30], [50, 12, 300, 90], 8, 2, 16, 16),
    "decode_head64_block32": ([1, 1], [33, 64], 4, 2, 64, 32),
}


@pytest.mark.parametrize("mode", ["fused", "kernel"])
@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_naive(name, mode, monkeypatch, variant=""):
    # split on small shapes
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=32,split_below=1000,part_cap=0" + variant)
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
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


@pytest.mark.parametrize("variant", [",num_stages=1", ",num_stages=3", ",direct=0", ",head_major=1", ",early=1",
                                     ",early=1,block_n=16", ",all_heads=1,num_warps=8",
                                     ",all_heads=1,num_warps=4,block_n=16"])
@pytest.mark.parametrize("name", ["decode_mha_split", "mixed_gqa4_split", "decode_head64_block32"])
def test_attention_variants_match_naive(name, variant, monkeypatch):
    """Pipelined or not (one-tile splits run with one stage), the first tile before the PDL wait or not (``early``;
    16-key tiles: splits of several tiles), every KV head of a request in one program or not (``all_heads``; 16-key
    tiles over 32-token blocks take each key's block from its position; steps with prompts run the plain kernel):
    the same results."""
    test_attention_matches_naive(name, "fused", monkeypatch, variant)


def test_split_heuristic():
    def plan(qlens, slens, block_q=1, merge_cap=0):
        tables = [list(range(-(-max(slens) // 16)))] * len(slens)
        md = cuda_attn.CudaAttentionMetadata(AttentionMetadata.build(qlens, slens, tables, 16), 132)
        return md.plan(block_q, 32, 32, 8, 128, 2, merge_cap=merge_cap)

    assert plan([1], [16384]).splits > 8  # one long decode: flash-decoding
    assert plan([1] * 256, [1024] * 256).splits == 1  # a big batch already fills the SMs
    assert plan([512], [4608], block_q=32).splits == 1  # fp32 partials of 512 queries would outweigh the KV
    assert plan([1], [8192]).splits == 64
    # a grid of at most half the SMs splits to ~4 programs per SM (one resident wave), a larger one to ~8
    assert plan([1] * 8, [4096] * 8).splits == 9  # 64 programs: ceil(4 * 132 / 64)
    assert plan([1] * 9, [4096] * 9).splits == 15  # 72 programs: ceil(8 * 132 / 72), 288-key splits
    # an overridden split_target is halved for small grids too, never to zero
    md = cuda_attn.CudaAttentionMetadata(AttentionMetadata.build([1], [8192], [list(range(512))], 16), 132)
    assert md.plan(1, 32, 32, 8, 128, 2, split_target=1).splits == 16  # ceil(132 / 8) = 17, in 512-key splits
    # fused merge: S * 4 rows * 4 B <= (8192 / S) * 2 * 2 B  ->  S <= 45 (then whole 32-key tiles: 43)
    assert plan([1], [8192], merge_cap=1).splits == 43
    for length in (100, 300, 1000, 5000, 16384):
        for b in (1, 2, 8):
            p = plan([1] * b, [length] * b, merge_cap=1)
            assert p.min_seg == 128
            # no split shorter than min_split, and none empty for the longest request
            assert p.splits == 1 or -(-length // p.splits) >= 128
            assert -(-length // -(-length // p.splits)) == p.splits
            assert p.splits * 8 * b <= 8 * 132 + 8 * b  # at most ~split_target programs per SM


@pytest.mark.parametrize("mode", ["fused", "kernel"])
def test_host_bounds_above_device_lengths(mode, monkeypatch):
    """What a CUDA-graph capture does: host lengths at an upper bound (more splits, a wider grid)
    while the device holds the real lengths; surplus splits and q blocks must contribute nothing."""
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=16")
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
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


def _guarded_cache(nb, bs, hkv, d):
    """A cache that is a view into a larger buffer: a write past either end lands in a guard block."""
    big = torch.full((nb + 2, 2, bs, hkv, d), 7.0, device=DEV)
    return big, big[1:-1]


def test_write_kv_never_writes_out_of_range(monkeypatch):
    monkeypatch.delenv("HWKV_CUDA_CHECK_SLOTS", raising=False)
    nb, bs, hkv, d = 3, 16, 2, 16
    key, value = torch.randn(6, hkv, d), torch.randn(6, hkv, d)
    slots = torch.tensor([5, nb * bs, -2, nb * bs + 17, -1 - bs, nb * bs - 1], dtype=torch.int64)
    big, kv = _guarded_cache(nb, bs, hkv, d)
    TritonAttentionBackend().make_impl(4, d, hkv, 1.0).write_kv(key.to(DEV), value.to(DEV), kv, slots.to(DEV))
    exp = torch.full((nb + 2, 2, bs, hkv, d), 7.0)
    for t, s in ((0, 5), (5, nb * bs - 1)):  # only the in-range slots are written
        exp[1 + s // bs, 0, s % bs], exp[1 + s // bs, 1, s % bs] = key[t], value[t]
    assert torch.equal(big.cpu(), exp)


@pytest.mark.parametrize("bad", [48, 1000, -2])
def test_write_kv_slot_check_names_the_slot(bad, monkeypatch):
    monkeypatch.setenv("HWKV_CUDA_CHECK_SLOTS", "1")
    nb, bs, hkv, d = 3, 16, 2, 16
    big, kv = _guarded_cache(nb, bs, hkv, d)
    impl = TritonAttentionBackend().make_impl(4, d, hkv, 1.0)
    k = torch.randn(3, hkv, d, device=DEV)
    slots = torch.tensor([0, -1, bad], dtype=torch.int64, device=DEV)
    msg = rf"slot_mapping value {bad} \(token 2\) out of range \[-1, 48\) for 3 blocks of 16"
    with pytest.raises(ValueError, match=msg):
        impl.write_kv(k, k, kv, slots)
    assert bool((big == 7.0).all()), "a refused write_kv must write nothing"
    impl.write_kv(k, k, kv, torch.tensor([0, -1, 47], dtype=torch.int64, device=DEV))  # in range: no error


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


def test_copy_blocks_tensors_kernel_one_launch_for_every_tensor():
    """Tensors in separate allocations (a device cache) and in one (a staging cache), reached as 16-byte
    offsets from the first; blocks outside the pairs stay untouched in every tensor."""
    from hwkv_cuda.kernels.cache import copy_blocks_tensors_kernel

    g = torch.Generator().manual_seed(3)
    src = [torch.randn(6, 2, 16, 2, 8, generator=g).to(DEV) for _ in range(3)]
    flat = torch.zeros(3 * 5 * src[0][0].numel() + 64, device=DEV)
    dst = [flat[64 + i * 5 * src[0][0].numel():][:5 * src[0][0].numel()].view(5, 2, 16, 2, 8) for i in range(3)]
    pairs = [[0, 4], [5, 1], [2, 0]]
    offs = [((a.data_ptr() - src[0].data_ptr()) // 16, (b.data_ptr() - dst[0].data_ptr()) // 16)
            for a, b in zip(src, dst)]
    table = torch.tensor([o for pair in offs for o in pair] + [x for p in pairs for x in p], dtype=torch.int64,
                         device=DEV)
    elems = src[0][0].numel()
    copy_blocks_tensors_kernel[(3, 3, -(-elems // 64))](src[0].view(torch.int32), dst[0].view(torch.int32), table,
                                                       table[6:], elems, CHUNK=64, PER_16=4)
    for s_t, d_t in zip(src, dst):
        for s, d in pairs:
            assert torch.equal(d_t[d], s_t[s])
        assert d_t[2].abs().sum() == 0 and d_t[3].abs().sum() == 0
    assert flat[:64].abs().sum() == 0


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
@pytest.mark.parametrize("mode", ["fused", "kernel"])
def test_cuda_graph_replay_after_metadata_is_gone(mode, monkeypatch):
    """The engine captures with throw-away metadata: the graph may read only the caller's tensors
    (and, fused, the impl's counters, which every replay must leave at zero)."""
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
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
    g.replay()
    torch.cuda.synchronize()
    assert all(int(b.count_nonzero()) == 0 for b in impl.counters.buffers.values())


FEATURE_CASES = {  # name: (case, window, softcap, sinks)
    "window_decode_split": ("decode_mha_split", 48, None, False),
    "window_prefill_on_prefix": ("prefill_on_prefix_gqa4", 13, None, False),
    "window_mixed_split": ("mixed_gqa4_split", 40, None, False),
    "window_wider_than_context": ("mixed_gqa4_split", 4096, None, False),
    "window_one": ("prefill_no_cache_mqa", 1, None, False),
    "softcap_mixed": ("mixed_gqa4_split", None, 0.5, False),
    "sinks_mixed_split": ("mixed_gqa4_split", None, None, True),
    "sinks_decode_split": ("decode_mha_split", None, None, True),
    "softcap_decode_split": ("decode_mha_split", None, 1.5, False),
    "all_prefill_no_cache": ("prefill_no_cache_mqa", 7, 2.0, True),
    "all_mixed_split": ("mixed_gqa4_split", 64, 3.0, True),
}


@pytest.mark.parametrize("mode", ["fused", "kernel"])
@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_window_softcap_sinks_match_naive(name, mode, monkeypatch):
    """Sliding window, logit soft-cap and per-head sinks against the naive definitions. Every key
    before the window of a request's first query row is NaN and the table entries of whole blocks
    there point at a NaN block: a kernel that read any of them (a decode reading past the window,
    or a freed block's stale entry) would return NaN."""
    _check_features(name, mode, monkeypatch)


@pytest.mark.parametrize("extra", [",prefetch=1", ",early=1", ",early=1,block_n=16", ",all_heads=1"])
@pytest.mark.parametrize("name", ["window_decode_split", "sinks_decode_split", "softcap_decode_split"])
def test_prefetched_decode_window_softcap_sinks(name, extra, monkeypatch):
    """The hand-prefetched decode loop (``prefetch=1``) loads the next tile's rows ahead, the early decode
    (``early=1``) its first tile before the PDL wait: they must still read nothing before the window (the NaN keys)
    and apply the soft-cap and the sinks. ``all_heads=1`` does not apply to these layers: the one-warp tile runs
    (``hwkv_cuda.tiles.ALL_HEADS_FALLBACK``)."""
    _check_features(name, "fused", monkeypatch, extra)


def _check_features(name, mode, monkeypatch, extra=""):
    case, window, softcap, with_sinks = FEATURE_CASES[name]
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=16,split_below=1000,part_cap=0" + extra)
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
    qlens, slens, h, hkv, d, bs = CASES[case]
    q, kv, md, tables = _case(qlens, slens, h, hkv, d, bs, seed=len(name))
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(5)) * 2 if with_sinks else None
    if window is not None:
        nan_block = kv.shape[0]
        kv = torch.cat([kv, torch.full_like(kv[:1], float("nan"))])
        for r, (ql, sl) in enumerate(zip(qlens, slens)):
            lo = max(0, sl - ql - window + 1)
            for p in range(lo):
                kv[tables[r][p // bs], :, p % bs] = float("nan")
            tables[r] = [nan_block if (b + 1) * bs <= lo else blk for b, blk in enumerate(tables[r])]
        md = AttentionMetadata.build(qlens, slens, tables, bs, device=DEV)
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.window, impl.softcap, impl.sinks = window, softcap, sinks
    built = TritonAttentionBackend().metadata_builder().build(md)
    out = torch.full_like(q, float("nan"), device=DEV)
    impl.forward_into(out, q.to(DEV), kv.to(DEV), built)
    ref = naive_attention(q, kv, qlens, slens, tables, d**-0.5, window=window, softcap=softcap, sinks=sinks)
    assert not ref.isnan().any()
    assert not out.isnan().any(), f"{name}: NaN (a key outside the window was read, or a row was not written)"
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-5, f"{name}: rel err {err:.2e}"
    if name == "window_wider_than_context":  # the window covers everything: the plain result exactly
        return
    plain = naive_attention(q, kv.nan_to_num(), qlens, slens, tables, d**-0.5)
    assert (plain - ref).norm() / ref.norm() > 1e-3, f"{name}: the feature changed nothing (the case has no teeth)"


def test_feature_parameters_are_checked():
    impl = TritonAttentionBackend().make_impl(4, 16, 2, 0.25)
    impl.window = 0
    with pytest.raises(ValueError, match="window must be >= 1"):
        impl._features(torch.device("cpu"))
    impl.window, impl.softcap = None, -1.0
    with pytest.raises(ValueError, match="softcap must be > 0"):
        impl._features(torch.device("cpu"))
    impl.softcap, impl.sinks = None, torch.zeros(3)
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        impl._features(torch.device("cpu"))
    impl.sinks = torch.zeros(4, dtype=torch.bfloat16)
    assert impl._features(torch.device("cpu"))["sinks_ptr"].dtype == torch.float32


def test_one_launch_plan_applies_only_where_every_tensor_fits(monkeypatch):
    """Offsets in 16-byte units from the first tensor, remembered per cache pair; ``None`` (one launch per
    tensor) host to host, from unpinned host memory, for blocks of different sizes or a non-contiguous
    tensor (caches as the KVCache checks would not build, duck-typed). The device side here: meta tensors
    (a device type other than the host's; their addresses are all 0)."""
    from hwkv_cuda.device import _launch_plan

    from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind

    spec = KVCacheSpec(3, 4, 16, 2, 8, torch.float32)
    a = KVCache.allocate(spec, KVLayoutKind.PER_LAYER, "cpu")
    b = _Tensors([torch.empty(8, 2, 16, 2, 8, device="meta") for _ in range(3)])
    assert _launch_plan(a, b) is None  # unpinned host memory
    assert _launch_plan(a, a) is None  # host to host
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    a = KVCache.allocate(spec, KVLayoutKind.PER_LAYER, "cpu")
    offs, unit, elems = _launch_plan(a, b)
    assert unit == torch.int32 and elems == 2 * 16 * 2 * 8
    want = [(s.data_ptr() - a.tensors[0].data_ptr()) // 16 for s in a.tensors]
    assert offs.view(-1, 2)[:, 0].tolist() == want and _launch_plan(a, b) is _launch_plan(a, b)
    odd = _Tensors([a.tensors[0], a.tensors[1], torch.zeros(4, 2, 16, 2, 4)])  # as a hybrid's groups
    assert _launch_plan(odd, b) is None
    strided = torch.zeros(4, 2, 16, 2, 16)[..., :8]
    assert _launch_plan(_Tensors([*a.tensors[:2], strided]), b) is None


class _Tensors:
    """A cache as far as the copy plan looks: its tensors (weak-referenceable, as a KVCache)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors


def test_full_grid_decode_tile_matches_naive(monkeypatch):
    """A decode whose unsplit grid fills the GPU (split_below=0: no split) at head 64 over a 16-bit cache takes the
    full-grid tile (one warp, 64-key tiles, head-major grid) and equals the naive attention, contexts shorter and
    longer than one tile, a partial last tile and a block table wider than the longest request included."""
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "split_below=0")
    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG_DECODE", raising=False)
    qlens, slens, h, hkv, d, bs = [1] * 5, [1, 63, 64, 200, 129], 8, 2, 64, 16
    q, kv, md, tables = _case(qlens, slens, h, hkv, d, bs, seed=5)
    dtype = torch.float16 if DEV == "cpu" else torch.bfloat16  # the interpreter's bf16 dots are numpy's
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    built = TritonAttentionBackend().metadata_builder().build(md)
    cfg, plan = built.launch(h, hkv, d, dtype, True)
    assert (cfg.block_n, cfg.num_warps, cfg.head_major, plan.splits) == (64, 1, 1, 1)
    out = torch.full_like(q, float("nan"), dtype=dtype, device=DEV)
    impl.forward_into(out, q.to(DEV, dtype), kv.to(DEV, dtype), built)
    ref = naive_attention(q.to(dtype).double(), kv.to(dtype).double(), qlens, slens, tables, d**-0.5)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert not out.isnan().any() and err < 2e-3, f"rel err {err:.2e}"

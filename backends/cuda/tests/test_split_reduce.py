"""Split-KV reductions: the fused last-split merge and the two-kernel path, against the naive
reference and each other (interpreter mode on CPU: programs run one after another, so these check
the merge logic and the counter protocol, not the memory ordering; the GPU test below runs it hot)."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from hwkv_cuda.splitkv import SplitCounters, merge_tile, reduce_mode  # noqa: E402
from naive import naive_attention, paged_case  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(mode, qlens, slens, h, hkv, d, bs, cfg, monkeypatch, seed=0, calls=1):
    """Outputs of ``calls`` forwards (fresh queries each) with their references, the metadata (its
    plans) and the impl (its counters)."""
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", cfg)
    q, kv, md, tables = paged_case(qlens, slens, h, hkv, d, bs, seed, DEV)
    built = TritonAttentionBackend().metadata_builder().build(md)
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    g = torch.Generator().manual_seed(seed + 1)
    results = []
    for i in range(calls):
        qi = q if i == 0 else torch.randn(q.shape, generator=g)
        out = torch.full_like(qi, float("nan"), device=DEV)  # poisoned: every element must be written
        impl.forward_into(out, qi.to(DEV), kv.to(DEV), built)
        results.append((out.cpu().double(), naive_attention(qi, kv, qlens, slens, tables, d**-0.5)))
    return results, built, impl


def _splits(built):
    return max(p.splits for p in built.plans.values())


def _rel(a, b):
    return float((a - b).norm() / b.norm())


SPLIT_CASES = {  # name: (query lens, seq lens, H, H_kv, D, block size, HWKV_CUDA_ATTN_CONFIG)
    # 2 splits; the 5-token request leaves its second split empty
    "gqa4_2_splits": ([1, 1], [5, 200], 8, 2, 16, 16, "min_split=96,split_below=1000,split_target=2"),
    # 22 splits (padded to 32): most of the short requests' splits are empty
    "gqa4_22_splits": ([1, 1, 1], [5, 40, 700], 8, 2, 16, 16, "min_split=16,split_below=1000,split_target=100"),
    # MHA, 1-row, 1-split merge loads: many row groups and split chunks per merge
    "mha_tiny_merge_tiles": ([1, 1], [90, 300], 4, 4, 16, 16,
                             "min_split=16,split_below=1000,split_target=100,merge_regs=1"),
    # group 3 (padded to 4 rows per token), prefill + decode mixed, prefill tiles merged in row groups
    # the hand-prefetched decode loop (prefetch=1): empty splits, a last tile past the split's end, MHA
    "gqa4_22_splits_prefetch": ([1, 1, 1], [5, 40, 700], 8, 2, 16, 16,
                                "min_split=16,split_below=1000,split_target=100,prefetch=1"),
    "mha_prefetch_block_n_64": ([1, 1], [90, 300], 4, 4, 16, 16,
                                "min_split=16,split_below=1000,split_target=3,block_n=64,prefetch=1"),
    # the first tile before the PDL wait (early=1): one-tile and 3-tile splits, empty splits
    "gqa4_22_splits_early": ([1, 1, 1], [5, 40, 700], 8, 2, 16, 16,
                             "min_split=16,split_below=1000,split_target=100,early=1"),
    "mha_early_block_n_16": ([1, 1], [90, 300], 4, 4, 16, 16,
                             "min_split=48,split_below=1000,split_target=3,block_n=16,early=1"),
    "mixed_gqa3": ([1, 12, 1, 30], [50, 12, 300, 90], 6, 2, 16, 16,
                   "min_split=16,split_below=1000,part_cap=0,merge_cap=0,merge_regs=2"),
}


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_fused_matches_naive_and_kernel_reduce(name, monkeypatch):
    qlens, slens, h, hkv, d, bs, cfg = SPLIT_CASES[name]
    fused, built, impl = _run("fused", qlens, slens, h, hkv, d, bs, cfg, monkeypatch, seed=len(name), calls=2)
    kernel, built_k, _ = _run("kernel", qlens, slens, h, hkv, d, bs, cfg, monkeypatch, seed=len(name))
    splits, splits_k = _splits(built), _splits(built_k)
    assert splits > 1 and splits == splits_k, f"{name}: meant to split (fused {splits}, kernel {splits_k})"
    for out, ref in fused + kernel:
        assert not out.isnan().any()
        assert _rel(out, ref) < 1e-5, f"{name}: rel err {_rel(out, ref):.2e}"
    # same fp32 merge math: the two reductions agree to fp32 rounding of the sums over splits
    assert _rel(fused[0][0], kernel[0][0]) < 1e-6
    # every launch hands its counters back at zero (the next call, or a graph replay, starts clean);
    # the second call reused the first one's buffer
    (buf,) = impl.counters.buffers.values()
    assert int(buf.count_nonzero()) == 0 and not impl.counters.retired


def test_unsplit_launch_needs_no_counters(monkeypatch):
    res, built, impl = _run("fused", [1, 4], [40, 60], 4, 2, 16, 16, "split_below=0", monkeypatch)
    assert _splits(built) == 1 and not impl.counters.buffers
    assert _rel(*res[0]) < 1e-5


def test_reduce_mode_env(monkeypatch):
    monkeypatch.delenv("HWKV_CUDA_SPLIT_REDUCE", raising=False)
    assert reduce_mode() == "fused"
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", "Kernel")
    assert reduce_mode() == "kernel"
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", "two-kernel")
    with pytest.raises(ValueError, match="HWKV_CUDA_SPLIT_REDUCE='two-kernel': expected one of fused, kernel"):
        reduce_mode()


def test_counters_grow_outside_capture_only(monkeypatch):
    c = SplitCounters()
    cpu = torch.device("cpu")
    small = c.get(cpu, 10)
    assert small.numel() == 1024 and small.dtype == torch.int32 and int(small.count_nonzero()) == 0
    assert c.get(cpu, 1024) is small
    big = c.get(cpu, 3000)
    assert big.numel() == 4096 and c.retired == [small]  # graphs captured on the old one keep it
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gpu = torch.device("cuda", 0)
    with pytest.raises(RuntimeError, match="cannot be allocated during CUDA-graph capture.*eager forward"):
        c.get(gpu, 8)
    c.buffers[gpu] = big  # warmed up before the capture: no allocation, no error
    assert c.get(gpu, 4096) is big


def test_merge_tile_fits_its_register_budget():
    for block_q, g_pad, sp, d_pad, warps in [(1, 4, 64, 128, 4), (1, 16, 8, 64, 4), (32, 4, 8, 128, 8),
                                              (64, 1, 2, 256, 4), (1, 1, 64, 512, 4)]:
        rows, splits = merge_tile(block_q, g_pad, sp, d_pad, warps, 32)
        assert rows <= block_q * g_pad and splits <= sp
        assert rows * splits * d_pad <= max(32 * 32 * warps, d_pad)
        assert rows & (rows - 1) == 0 and splits & (splits - 1) == 0


def test_plan_merge_cap_only_in_fused_mode(monkeypatch):
    """The fused merge is serial in one program, so its plan may cap splits (when asked: the cap is
    off by default); the kernel path's never."""
    for mode, extra, cap in (("fused", ",merge_cap=1", 1), ("kernel", ",merge_cap=1", 0), ("fused", "", 0)):
        _, built, _ = _run(mode, [1], [300], 8, 2, 16, 16, "min_split=16,split_below=1000" + extra, monkeypatch)
        assert {key.merge_cap for key in built.plans} == {cap}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the race needs a GPU")
@pytest.mark.parametrize("mode", ["fused", "kernel"])
def test_split_reduce_hot_on_gpu(mode, monkeypatch):
    """Many back-to-back launches with fresh queries: a merge that read partials before they were
    visible would read another launch's (or uninitialised) values and miss the reference."""
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
    q, kv, md, tables = paged_case([1, 1], [8000, 3000], 32, 8, 128, 16, 11, "cuda")
    kv = kv.to("cuda", torch.bfloat16)
    impl = TritonAttentionBackend().make_impl(32, 128, 8, 128**-0.5)
    built = TritonAttentionBackend().metadata_builder().build(md)
    qs = torch.randn(100, *q.shape, device="cuda", dtype=torch.bfloat16)
    outs = torch.empty_like(qs)
    for i in range(qs.shape[0]):
        impl.forward_into(outs[i], qs[i], kv, built)
    torch.cuda.synchronize()
    assert max(p.splits for p in built.plans.values()) > 8
    for i in range(0, qs.shape[0], 9):
        ref = naive_attention(qs[i], kv, [1, 1], [8000, 3000], tables, 128**-0.5)
        assert _rel(outs[i].double(), ref) < 1e-2, f"call {i}"
    if mode == "fused":
        assert int(impl.counters.buffers[qs.device].count_nonzero()) == 0


def test_short_splits_run_as_one_tile(monkeypatch):
    """Split decodes take 128-key tiles from 512 keys per split, 32-key ones below, one unpipelined
    128-key tile when every split is that short; head 256 and fp32 (shared memory) keep 32; unsplit
    decodes take 128 keys up to head 64, 64 above."""
    from dataclasses import replace

    from hwkv_cuda.tiles import ALL_HEADS_FALLBACK, FP8_LONG_SPLIT, SHORT_SPLIT, choose_config

    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    bf16 = torch.bfloat16
    assert choose_config(1, 4, 128, bf16).block_n == 64
    assert choose_config(1, 4, 128, bf16, split=True, seg=512).block_n == 128
    assert choose_config(1, 4, 128, bf16, split=True, seg=256).block_n == 32  # 2 tiles of 128: slower (H100)
    assert choose_config(1, 4, 64, bf16).block_n == 128
    assert choose_config(1, 4, 64, bf16, split=True, seg=SHORT_SPLIT).block_n == SHORT_SPLIT == 128
    assert choose_config(1, 4, 256, bf16, split=True, seg=64).block_n == 32
    assert choose_config(1, 4, 128, torch.float32, split=True, seg=64).block_n == 32
    # prefill tiles do not follow the split; they follow the grid: 128-key tiles on 8 warps for a small
    # one, 64-key tiles on 4 warps from two programs per SM on (wide)
    assert choose_config(16, 4, 128, bf16, split=True, seg=64) == choose_config(16, 4, 128, bf16)
    small, wide = choose_config(16, 4, 128, bf16), choose_config(16, 4, 128, bf16, wide=True)
    assert (small.block_n, small.num_warps, wide.block_n, wide.num_warps) == (128, 8, 64, 4)
    assert choose_config(16, 4, 256, bf16, wide=True) == choose_config(16, 4, 256, bf16)  # head 256: as before
    # head <= 64: the wide grid's 128-row tiles take 8 warps too; the 64-row tiles of mostly-decode steps keep 4
    w64, short64 = choose_config(16, 4, 64, bf16, wide=True), choose_config(16, 4, 64, bf16, wide=True, short=True)
    assert (w64.block_m, w64.block_n, w64.num_warps, short64.block_m, short64.num_warps) == (128, 64, 8, 64, 4)
    # a one-tile split runs unpipelined; longer splits and full grids keep the three-stage pipeline
    assert choose_config(1, 4, 128, bf16, split=True, seg=SHORT_SPLIT).num_stages == 1
    assert choose_config(1, 4, 128, bf16, split=True, seg=256).num_stages == 3
    assert choose_config(1, 4, 128, bf16).num_stages == 3
    # an fp8 cache read by a 16-bit query: a split decode casts e4m3 tiles to fp16 (rows of 256 keys,
    # fp8_unpack=6, up to head 64; [D, keys] tiles of 128, fp8_unpack=4, above); prefill, unsplit and
    # one-tile splits as before; fp32 queries keep their tiles
    assert choose_config(1, 4, 128, bf16, kv_elem=1).block_n == 128
    fp8 = choose_config(1, 4, 64, bf16, split=True, seg=512, kv_elem=1)
    assert (fp8.block_n, fp8.fp8_unpack) == (256, 6)
    # splits of >= FP8_LONG_SPLIT keys at head <= 64 (32 x 32k): every KV head of a request in one program
    # (all_heads: 4 warps, 32-key tiles, 5 stages), split_target 15; where it does not apply (window, soft-cap,
    # sinks) the one-warp tile of 64 keys and 5 stages (ALL_HEADS_FALLBACK); head 128 keeps its tile
    fp8 = choose_config(1, 4, 64, bf16, split=True, seg=FP8_LONG_SPLIT, kv_elem=1)
    assert (fp8.all_heads, fp8.block_n, fp8.fp8_unpack, fp8.num_warps, fp8.num_stages, fp8.split_target,
            fp8.head_major) == (1, 32, 7, 4, 5, 15, 1)
    back = replace(fp8, all_heads=0, **ALL_HEADS_FALLBACK)
    assert (back.block_n, back.num_warps, back.num_stages, back.fp8_unpack, back.maxnreg) == (64, 1, 5, 7, 0)
    assert choose_config(1, 4, 128, bf16, split=True, seg=FP8_LONG_SPLIT, kv_elem=1).all_heads == 0
    assert choose_config(1, 4, 64, bf16, split=True, seg=FP8_LONG_SPLIT - 1, kv_elem=1).block_n == 256
    assert choose_config(1, 4, 64, bf16, split=True, seg=FP8_LONG_SPLIT).num_warps == 4  # a 16-bit cache
    fp8 = choose_config(1, 4, 128, bf16, split=True, seg=4096, kv_elem=1)
    assert (fp8.block_n, fp8.fp8_unpack) == (128, 4)
    fp8 = choose_config(1, 4, 64, bf16, split=True, seg=256, kv_elem=1)
    assert (fp8.block_n, fp8.fp8_unpack) == (64, 0)
    assert choose_config(1, 4, 64, bf16, split=True, seg=512).fp8_unpack == 0  # a 16-bit cache
    assert choose_config(1, 4, 64, bf16, split=True, seg=SHORT_SPLIT, kv_elem=1).block_n == SHORT_SPLIT
    assert choose_config(16, 4, 128, bf16, kv_elem=1) == choose_config(16, 4, 128, bf16)
    assert choose_config(1, 4, 128, torch.float32, kv_elem=1) == choose_config(1, 4, 128, torch.float32)


def test_tiles_fit_the_devices_shared_memory(monkeypatch):
    """H100 tiles stay as tuned; smaller GPUs drop stages, then keys; nothing fits -> a clear error."""
    from hwkv_cuda.tiles import choose_config, fit_shared_memory, smem_bytes

    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    bf16 = torch.bfloat16
    h100, a100, ada = 232448, 166912, 101376  # shared_memory_per_block_optin
    shapes = [dict(max_query_len=q, group=g, head_size=d, dtype=dt, split=sp, seg=seg, wide=w)
              for q in (1, 64) for g in (1, 4, 8, 16, 64) for d in (64, 128, 256) for dt in (bf16, torch.float32)
              for sp, seg in ((False, 0), (True, 128), (True, 512)) for w in (False, True)]
    for kw in shapes:
        cfg = choose_config(**kw)
        d_pad, elem = max(16, kw["head_size"]), kw["dtype"].itemsize
        if kw["group"] <= 8:  # the tuned shapes (groups of up to 8 query heads per KV head) fit an H100 as they are
            assert fit_shared_memory(cfg, d_pad, elem, h100) == cfg, kw
        assert fit_shared_memory(cfg, d_pad, elem, 0) == cfg  # unknown limit: unchanged
        for limit in (h100, a100, ada):
            fit = fit_shared_memory(cfg, d_pad, elem, limit)
            assert smem_bytes(fit, d_pad, elem) <= limit and fit.block_m == cfg.block_m, (kw, limit)
            assert fit.block_n <= cfg.block_n and fit.num_stages <= cfg.num_stages
    fp8_split = choose_config(1, 4, 64, bf16, split=True, seg=512, kv_elem=1)  # 256 fp8 keys: the bytes of 128 bf16
    assert smem_bytes(fp8_split, 64, 2, 1) == smem_bytes(choose_config(1, 4, 64, bf16, split=True, seg=512), 64, 2)
    assert fit_shared_memory(fp8_split, 64, 2, ada, 1) == fp8_split
    prefill = choose_config(64, 4, 128, bf16)  # 128-key tiles, three stages: 224 KB
    assert (fit_shared_memory(prefill, 128, 2, a100).block_n, fit_shared_memory(prefill, 128, 2, a100).num_stages) \
        == (128, 2)
    assert (fit_shared_memory(prefill, 128, 2, ada).block_n, fit_shared_memory(prefill, 128, 2, ada).num_stages) \
        == (64, 2)
    with pytest.raises(ValueError, match="needs ~.* bytes of shared memory; the device allows 4096"):
        fit_shared_memory(prefill, 128, 2, 4096)


def test_override_fields_survive_the_fit(monkeypatch):
    """A sweep row runs what it is labelled with: the fit shrinks only fields the override left alone,
    and says so when that is not enough."""
    from hwkv_cuda.tiles import choose_config, fit_shared_memory

    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "num_stages=3")
    cfg = choose_config(64, 4, 128, torch.bfloat16)
    fit = fit_shared_memory(cfg, 128, 2, 166912)  # A100: keys shrink instead of stages
    assert (fit.num_stages, fit.block_n) == (3, 64)
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "num_stages=3,block_n=128")
    with pytest.raises(ValueError, match=r"HWKV_CUDA_ATTN_CONFIG fixes \['block_n', 'num_stages'\]"):
        fit_shared_memory(choose_config(64, 4, 128, torch.bfloat16), 128, 2, 166912)


def test_fp8_override_applies_only_to_an_fp8_cache(monkeypatch):
    """HWKV_CUDA_ATTN_CONFIG_FP8 goes on top of HWKV_CUDA_ATTN_CONFIG for a 1-byte cache only, so one
    process can run each cache with its own tiles."""
    from hwkv_cuda.tiles import choose_config

    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "block_n=128,num_warps=8")
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG_FP8", "block_n=256,fp8_unpack=1")
    bf16 = choose_config(1, 4, 64, torch.bfloat16, split=True, seg=4096)
    fp8 = choose_config(1, 4, 64, torch.bfloat16, split=True, seg=4096, kv_elem=1)
    assert (bf16.block_n, bf16.num_warps, bf16.fp8_unpack) == (128, 8, 0)
    assert (fp8.block_n, fp8.num_warps, fp8.fp8_unpack) == (256, 8, 1)
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG_FP8", "fp8_unpak=1")
    with pytest.raises(ValueError, match="HWKV_CUDA_ATTN_CONFIG_FP8: 'fp8_unpak=1'"):
        choose_config(1, 4, 64, torch.bfloat16, kv_elem=1)


def test_decode_override_applies_only_to_a_16_bit_decode(monkeypatch):
    """HWKV_CUDA_ATTN_CONFIG_DECODE goes on top of HWKV_CUDA_ATTN_CONFIG for a step of one query token per
    request over a 16-bit cache: an engine A/B of decode tiles keeps the prefill, mixed and fp8 tiles."""
    from hwkv_cuda.tiles import choose_config, fit_shared_memory

    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "num_warps=8")
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG_DECODE", "block_n=64,prefetch=1")
    dec = choose_config(1, 4, 64, torch.bfloat16)
    pre = choose_config(64, 4, 64, torch.bfloat16)
    fp8 = choose_config(1, 4, 64, torch.bfloat16, kv_elem=1)
    assert (dec.block_n, dec.prefetch, dec.num_warps) == (64, 1, 8)
    assert (pre.prefetch, pre.num_warps) == (0, 8) and pre.block_n != 64
    assert (fp8.prefetch, fp8.block_n) == (0, 128)
    # the fields it fixes are not shrunk to fit shared memory
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG_DECODE", "block_n=128,num_stages=8")
    with pytest.raises(ValueError, match=r"fixes \['block_n', 'num_stages', 'num_warps'\]"):
        fit_shared_memory(choose_config(1, 4, 64, torch.bfloat16), 64, 2, 166912)
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG_DECODE", "prefech=1")
    with pytest.raises(ValueError, match="HWKV_CUDA_ATTN_CONFIG_DECODE: 'prefech=1'"):
        choose_config(1, 4, 64, torch.bfloat16)


@pytest.mark.parametrize("qlens,wide", [([40], False), ([40, 40, 40], True), ([9, 9, 9], False)])
def test_prefill_tiles_follow_the_program_count(qlens, wide, monkeypatch):
    """The wide-grid decision counts programs with work, two per SM (4 SMs here): fp32 prefill tiles
    hold 16 tokens, so three 9-token requests are 3 q blocks x 2 KV heads = 6 programs, though the
    grid's upper bound has 8. (fp32 tiles are the same either way; bf16 ones differ, tested above.)"""
    import hwkv_cuda.attention as attn

    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    seen = []
    real = attn.choose_config
    monkeypatch.setattr(attn, "choose_config", lambda *a, **kw: seen.append(kw.get("wide", False)) or real(*a, **kw))
    slens = [q + 5 for q in qlens]
    q, kv, md, tables = paged_case(qlens, slens, 8, 2, 16, 16, 0, DEV)
    built = TritonAttentionBackend().metadata_builder().build(md)
    built.num_sms = 4
    out = torch.full_like(q, float("nan"), device=DEV)
    TritonAttentionBackend().make_impl(8, 16, 2, 0.25).forward_into(out, q.to(DEV), kv.to(DEV), built)
    assert seen[-1] is wide and not out.isnan().any()
    ref = naive_attention(q, kv, qlens, slens, tables, 0.25)
    assert _rel(out.cpu().double(), ref) < 1e-5


def test_tiles_are_chosen_once_per_step(monkeypatch):
    """Every layer of a step has the same shape: its tiles and plan are chosen on the first layer's
    forward and reused; a changed HWKV_CUDA_ATTN_CONFIG (a sweep in one process) chooses again."""
    import hwkv_cuda.attention as attn

    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    calls = []
    real = attn.choose_config
    monkeypatch.setattr(attn, "choose_config", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    q, kv, md, tables = paged_case([1, 1], [300, 40], 8, 2, 16, 16, 0, DEV)
    built = TritonAttentionBackend().metadata_builder().build(md)
    impl = TritonAttentionBackend().make_impl(8, 16, 2, 0.25)
    ref = naive_attention(q, kv, [1, 1], [300, 40], tables, 0.25)
    for layer in range(3):
        out = torch.full_like(q, float("nan"), device=DEV)
        impl.forward_into(out, q.to(DEV), kv.to(DEV), built)
        assert _rel(out.cpu().double(), ref) < 1e-5, layer
        if layer == 0:
            first = len(calls)
    assert first > 0 and len(calls) == first and len(built.launches) == 1
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=16,split_below=1000")
    impl.forward_into(out, q.to(DEV), kv.to(DEV), built)
    assert len(built.launches) == 2 and len(calls) > first
    assert max(p.splits for p in built.plans.values()) > 1 and _rel(out.cpu().double(), ref) < 1e-5


@pytest.mark.parametrize("value,bad", [("blockn=64", "'blockn=64'"), ("block_n=wide", "'block_n=wide'"),
                                       ("num_warps", "'num_warps'")])
def test_bad_override_names_the_item_and_the_allowed_names(value, bad, monkeypatch):
    from hwkv_cuda.decode_ops import DenseConfig
    from hwkv_cuda.decode_ops import choose_config as dense_config
    from hwkv_cuda.tiles import choose_config

    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", value)
    with pytest.raises(ValueError, match=f"HWKV_CUDA_ATTN_CONFIG: {bad} is not name=integer with a name among "
                                         "block_m, block_q, block_n, num_warps, num_stages, split_below"):
        choose_config(1, 4, 128, torch.bfloat16)
    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG")
    monkeypatch.setenv("HWKV_CUDA_DENSE_CONFIG", value)
    names = ", ".join(DenseConfig._fields)  # every field, in order (the list grows with the GEMV's options)
    assert names.startswith("block_n, block_k, num_warps, num_stages, preload, evict, split_k, maxnreg")
    with pytest.raises(ValueError, match=f"HWKV_CUDA_DENSE_CONFIG: {bad} is not name=integer with a name among "
                                         f"{names}$"):
        dense_config(1, 2048, 2048)


def test_early_decode_is_auto_for_one_tile_splits(monkeypatch):
    """``early`` left at auto: a pure decode whose splits are one tile each loads its first tile before the PDL wait
    (and merges in one pass); longer splits, unsplit launches and prefills do not; ``early=0`` turns it off."""
    import hwkv_cuda.kernels.attention as kernels

    seen, real = [], kernels.attention_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw["EARLY"])
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(kernels, "attention_kernel", Spy())
    cases = [  # (query lens, seq lens, config, EARLY)
        # fp32 takes 32-key tiles: 22 splits of 32 keys
        ([1, 1, 1], [5, 40, 700], "min_split=16,split_below=1000,split_target=100,part_cap=0", True),
        ([1, 1, 1], [5, 40, 700], "min_split=16,split_below=1000,split_target=100,part_cap=0,early=0", False),
        ([1, 1, 1], [5, 40, 700], "min_split=16,split_below=1000,split_target=100", False),  # 11 splits of 64
        ([1, 1], [90, 300], "min_split=48,split_below=1000,split_target=3,block_n=16", False),  # 3 tiles a split
        ([1, 1], [90, 300], "split_below=0", False),  # unsplit
        ([1, 12, 1, 30], [50, 12, 300, 90], "min_split=16,split_below=1000", False),  # a prefill beside decodes
    ]
    for qlens, slens, cfg, want in cases:
        seen.clear()
        results, _, _ = _run("fused", qlens, slens, 8, 2, 16, 16, cfg, monkeypatch)
        assert seen == [want], (cfg, seen)
        for out, ref in results:
            assert _rel(out, ref) < 1e-5

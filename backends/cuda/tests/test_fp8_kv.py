"""fp8 (e4m3) KV cache in the Triton kernels against the reference oracle (hwkv.interfaces.kv_quant,
hwkv.reference.attention): the write kernel and the fused decode ops' KV write must store the very
bytes the reference stores; attention (prefill, prefill on a prefix, decode, split-KV with both
reductions) must equal the reference over the same fp8 cache. Interpreter mode on CPU, compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from hwkv_cuda.decode_ops import TritonDecodeOps  # noqa: E402
from naive import paged_case  # noqa: E402
from test_kernels import CASES  # noqa: E402

from hwkv.interfaces.kv_quant import FP8_E4M3, v_token_view  # noqa: E402
from hwkv.model.decode_ops import TorchDecodeOps  # noqa: E402
from hwkv.reference.attention import ReferenceAttentionBackend, paged_attention  # noqa: E402
from hwkv.reference.attention import write_kv as ref_write_kv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _scales(hkv, seed):
    g = torch.Generator().manual_seed(seed)
    return (0.02 + torch.rand(2, hkv, generator=g) * 0.1).to(DEV)  # per head, K row then V row; not 1.0


def _fp8_cache(kv, scales):
    """The fp8 cache the reference write stores for float ``kv`` [nb, 2, bs, Hkv, D] (every slot)."""
    nb, _, bs, hkv, d = kv.shape
    cache = torch.zeros(kv.shape, dtype=FP8_E4M3, device=DEV)
    slots = torch.arange(nb * bs, device=DEV)
    flat = kv.to(DEV).transpose(1, 2).reshape(nb * bs, 2, hkv, d)
    ref_write_kv(flat[:, 0], flat[:, 1], cache, slots, scales)
    return cache


@pytest.mark.parametrize("hkv,d,bs", [(2, 32, 16), (3, 64, 32)])
def test_write_kv_stores_the_reference_bytes(hkv, d, bs):
    g = torch.Generator().manual_seed(hkv * d)
    n, nb = 40, 4
    key = (torch.randn(n, hkv, d, generator=g) * 4).to(DEV)
    value = (torch.randn(n, hkv, d, generator=g) * 4).to(DEV)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-6, 0.0])  # saturates at +-448, subnormal, zero
    slots = torch.randperm(nb * bs, generator=g)[:n].to(DEV)
    slots[3] = -1  # padding: never written
    scales = _scales(hkv, d)
    impl = TritonAttentionBackend().make_impl(2 * hkv, d, hkv, d**-0.5)
    impl.kv_scales = scales
    got = torch.zeros(nb, 2, bs, hkv, d, dtype=FP8_E4M3, device=DEV)
    want = torch.zeros_like(got)
    impl.write_kv(key, value, got, slots)
    ref_write_kv(key, value, want, slots, scales)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.float().abs().max() == 448.0  # saturated, not inf/NaN


# prefill on a prefix (GQA 4), split decode (MHA), mixed prefill + split decode: every kernel path
FP8_CASES = ["prefill_on_prefix_gqa4", "decode_mha_split", "mixed_gqa4_split"]
READS = {"cast": "", "unpack": ",fp8_unpack=1", "rows": ",fp8_unpack=2", "unpack16": ",fp8_unpack=3",
         "cast16": ",fp8_unpack=4", "rows16": ",fp8_unpack=6", "vrows16": ",fp8_unpack=7",
         "prefetch": ",prefetch=1", "all_heads": ",all_heads=1,num_warps=8",
         "all_heads32": ",all_heads=1,num_warps=8,block_n=32"}


@pytest.mark.parametrize("mode,read", [("fused", "cast"), ("kernel", "cast"), ("fused", "unpack"),
                                       ("kernel", "rows"), ("fused", "unpack16"), ("fused", "cast16"),
                                       ("kernel", "rows16"), ("fused", "vrows16"), ("kernel", "vrows16"),
                                       ("fused", "prefetch"), ("kernel", "prefetch"), ("fused", "all_heads"),
                                       ("kernel", "all_heads32")])
@pytest.mark.parametrize("name", FP8_CASES)
def test_attention_dequantises_like_the_reference(name, mode, read, monkeypatch):
    """Every way of reading the cache (``fp8_unpack``, an HWKV_CUDA_ATTN_CONFIG field): e4m3 tiles cast
    to the query dtype (0), int16 words of two codes unpacked in registers (1), e4m3 rows cast with K
    transposed after the cast (2), 1 with fp16 dots for bf16 queries (3: fp32 queries here, as 1), 0 and 2
    with fp16 dots for bf16 queries (4 and 6: as 0 and 2 here), 4 with V cast in its rows (7); and the decode
    loop that prefetches the next tile's rows by hand (``prefetch=1``: the decode case; prefills ignore it)."""
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "min_split=32,split_below=1000,part_cap=0" + READS[read])
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
    qlens, slens, h, hkv, d, bs = CASES[name]
    q, kv, md, tables = paged_case(qlens, slens, h, hkv, d, bs, seed=len(name), device=DEV)
    scales = _scales(hkv, len(name))
    cache = _fp8_cache(kv / 0.05, scales)  # values ~ 20 / scale: the whole e4m3 range is used
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.kv_scales = scales
    built = TritonAttentionBackend().metadata_builder().build(md)
    out = torch.full_like(q, float("nan"), device=DEV)
    impl.forward_into(out, q.to(DEV), cache, built)
    ref = paged_attention(q.to(DEV), cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, d**-0.5,
                          kv_scales=scales)
    assert not out.isnan().any()
    # fp32 queries: the same dequantised values on both sides (K's scale folded into the score scale
    # on the GPU side is the only extra rounding), so fp32 tolerance holds
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < 1e-5, f"{name}: rel err {err:.2e}"
    # and the scales are really applied: with 1.0 the result is different
    impl.kv_scales = torch.ones_like(scales)
    out1 = torch.empty_like(out)
    impl.forward_into(out1, q.to(DEV), cache, built)
    assert (out1.double() - ref.double()).norm() / ref.double().norm() > 1e-2


@pytest.mark.parametrize("read", ["cast", "unpack", "cast16", "rows16", "vrows16", "prefetch", "all_heads"])
@pytest.mark.parametrize("split", [False, True], ids=["one_split", "split"])
def test_half_decode_over_fp8_takes_double_key_tiles(split, read, monkeypatch):
    """A split 16-bit decode over an fp8 cache runs twice the keys per tile of a 16-bit cache (same bytes
    per tile, half the iterations), and still equals the reference over the same fp8 cache, read either way. fp16: the
    Triton interpreter computes bf16 dots wrongly (numpy has no bf16); bf16 takes the same tiles."""
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", ("min_split=256,split_below=1000,part_cap=0" if split else
                                                 "split_below=0") + READS[read])
    qlens, slens, h, hkv, d, bs = [1, 1, 1], [70, 900, 130], 8, 2, 64, 16  # split: 3 x 300 keys
    q, kv, md, tables = paged_case(qlens, slens, h, hkv, d, bs, seed=11, device=DEV)
    scales = _scales(hkv, 11)
    cache = _fp8_cache(kv / 0.05, scales)
    built = TritonAttentionBackend().metadata_builder().build(md)
    half = torch.float16
    bf16_cfg = built.launch(h, hkv, d, torch.bfloat16, True, FP8_E4M3)[0]
    assert bf16_cfg == built.launch(h, hkv, d, half, True, FP8_E4M3)[0]
    cfg, plan = built.launch(h, hkv, d, half, True, FP8_E4M3)
    base, _ = built.launch(h, hkv, d, half, True, half)
    # splits of ~300 keys (< LONG_SPLIT): 64 fp8 keys, the bytes of the 16-bit cache's 32; unsplit: 128 fp8 keys, and
    # the 16-bit cache takes the full unsplit grid's one-warp 64-key tile (tiles.choose_config, ``full``)
    assert (cfg.block_n, base.block_n) == ((64, 32) if split else (128, 64)) and (plan.splits > 1) == split
    assert cfg.fp8_unpack == (int(READS[read][-1]) if READS[read] and read in ("unpack", "cast16", "rows16",
                                                                               "vrows16") else 0)
    assert cfg.prefetch == (read == "prefetch") and cfg.all_heads == (read == "all_heads")
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.kv_scales = scales
    out = torch.full_like(q, float("nan"), dtype=half, device=DEV)
    impl.forward_into(out, q.to(DEV, half), cache, built)
    ref = paged_attention(q.to(DEV, half).float(), cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables,
                          d**-0.5, kv_scales=scales)
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    assert err < 2e-3, f"rel err {err:.2e}"  # fp16 P in the P.V product: ~2^-11 relative


def test_reference_impl_reads_what_it_wrote():
    """The oracle itself: an fp8 cache read back equals attention over the dequantised values."""
    qlens, slens, h, hkv, d, bs = CASES["prefill_on_prefix_gqa4"]
    q, kv, md, tables = paged_case(qlens, slens, h, hkv, d, bs, seed=5, device=DEV)
    scales = _scales(hkv, 5)
    cache = _fp8_cache(kv, scales)
    # token-major values: the V pages' codes through their token view ([H_kv, D, block_size] stored)
    deq = torch.stack([cache[:, 0].float(), v_token_view(cache[:, 1]).float()], 1)
    deq = deq * torch.stack([scales[0], scales[1]])[None, :, None, :, None]
    impl = ReferenceAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.kv_scales = scales
    got = impl.forward(q.to(DEV), None, None, cache, md)
    want = paged_attention(q.to(DEV), deq, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, d**-0.5)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    # quantisation error of the cache itself: e4m3 keeps 3 mantissa bits (relative step 2^-4 at most)
    assert ((deq - kv.to(DEV)).abs() <= kv.to(DEV).abs() * 2**-4 + 2**-9 * scales.max()).all()


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (2, 2, 32)])
def test_decode_ops_kv_write_quantises_like_the_reference(heads, kv_heads, d):
    gen = torch.Generator().manual_seed(heads * d + 1)
    m, k, nb, bs, max_pos = 3, 64, 4, 16, 64
    n = (heads + 2 * kv_heads) * d
    dtype = torch.float32
    w = (torch.randn(n, k, generator=gen) * 0.3).to(DEV)
    nw = torch.randn(k, generator=gen).to(DEV)
    h = torch.randn(m, k, generator=gen).to(DEV)
    ang = torch.arange(max_pos)[:, None] * (1.0 / 100 ** (torch.arange(0, d, 2) / d))[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    pos = torch.tensor([5, 17, 63], device=DEV)
    slots = torch.tensor([3, -1, 40], device=DEV)
    scales = _scales(kv_heads, d)
    impls = [TritonAttentionBackend().make_impl(heads, d, kv_heads, d**-0.5),
             ReferenceAttentionBackend().make_impl(heads, d, kv_heads, d**-0.5)]
    for impl in impls:
        impl.kv_scales = scales
    caches = [torch.zeros((nb, 2, bs, kv_heads, d), dtype=FP8_E4M3, device=DEV) for _ in range(2)]
    got = TritonDecodeOps().qkv(h, nw, 1e-5, w, None, cos, sin, pos, impls[0], caches[0], slots, heads, kv_heads, d)
    want = TorchDecodeOps().qkv(h, nw, 1e-5, w, None, cos, sin, pos, impls[1], caches[1], slots, heads, kv_heads, d)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # the same fp8 codes, but for values within an fp32 rounding of a rounding boundary: at most one code apart
    diff = (caches[0].view(torch.uint8).int() - caches[1].view(torch.uint8).int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    assert caches[0].float().abs().sum() > 0


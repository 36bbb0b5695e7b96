"""The transposed fp8-KV decode kernel (HWKV_CUDA_FP8T=1, hwkv_cuda.attention_fp8t) against the reference
oracle over the same fp8 cache, as test_fp8_kv's decode tests: one split and several, both reductions, GQA and
MHA, partial last tiles, empty splits, both 16-bit query dtypes. Interpreter mode on CPU, compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda import attention_fp8t as fp8t  # noqa: E402
from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from naive import paged_case  # noqa: E402
from test_fp8_kv import DEV, _fp8_cache, _route_matches_reference, _route_refusals, _scales, _spy_route  # noqa: E402


@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", ["fused", "kernel"])
@pytest.mark.parametrize("shape", [(8, 2, 64, 16), (4, 4, 32, 32), (4, 1, 16, 16)], ids=["gqa4", "mha", "mqa4_d16"])
@pytest.mark.parametrize("splits", ["splits=1", "min_split=128", "splits=5"])
def test_fp8t_decode_equals_the_reference(splits, shape, mode, qdtype, monkeypatch, read=""):
    monkeypatch.setenv(fp8t.ENV, "1")
    monkeypatch.setenv(fp8t.CONFIG_ENV, splits + read)
    monkeypatch.setenv("HWKV_CUDA_SPLIT_REDUCE", mode)
    calls = _spy_route(monkeypatch, fp8t, "forward_fp8t")
    h, hkv, d, bs = shape
    qlens, slens = [1, 1, 1], [70, 900, 130]  # partial last tiles
    q, kv, md, tables = paged_case(qlens, slens, h, hkv, d, bs, seed=h * d + bs, device=DEV)
    scales = _scales(hkv, d)
    cache = _fp8_cache(kv / 0.05, scales)  # values ~ 20 / scale: the whole e4m3 range is used
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.kv_scales = scales
    built = TritonAttentionBackend().metadata_builder().build(md)
    # min_split=128: 2-4 splits of 256-512 keys (4 interpreter SMs), the short requests' later ones empty
    assert 2 <= fp8t.splits_for(built, hkv, 128, 4, 128) <= 4 and fp8t.splits_for(built, hkv, 128, 4, 512) == 1
    qd = q.to(DEV, qdtype)
    _route_matches_reference(impl, qd, cache, built, md, scales, calls)


@pytest.mark.parametrize("read", ["lacc=0", "num_warps=4,block_n=128", "num_warps=4,block_n=64,lacc=0",
                                  "num_warps=2,block_n=256"])
@pytest.mark.parametrize("splits", ["splits=1", "min_split=128"])
def test_fp8t_tiles_equal_the_reference(splits, read, monkeypatch):
    """The tiles beside the default (one warp, 64 keys): the 4-warp wgmma tiles, two warps over 256 keys, and the
    softmax sum reduced per tile (``lacc=0``) read and sum the same."""
    test_fp8t_decode_equals_the_reference(splits, (8, 2, 64, 16), "fused", torch.float16, monkeypatch, "," + read)


def test_fp8t_head128_equals_the_reference(monkeypatch):
    """Head 128 (the 8B shape's), both query dtypes' fp16 dots, split."""
    test_fp8t_decode_equals_the_reference("min_split=128", (8, 2, 128, 16), "fused", torch.float16, monkeypatch)


@pytest.mark.parametrize("bs", [1, 8])
def test_fp8t_small_blocks_equal_the_reference(bs, monkeypatch):
    """Blocks of fewer than 16 keys (V's codes no longer run 16 bytes at a time): still the reference."""
    test_fp8t_decode_equals_the_reference("min_split=128", (8, 2, 64, bs), "fused", torch.float16, monkeypatch)


def test_fp8t_takes_only_plain_fp8_decodes(monkeypatch):
    """Prefill steps, 16-bit caches, fp32 queries and windowed layers keep the unified kernel (and stay right)."""
    monkeypatch.setenv(fp8t.ENV, "1")
    calls = _spy_route(monkeypatch, fp8t, "forward_fp8t")
    impl, dmd, qd, cache, out, ref = _route_refusals()
    assert (out.double() - ref.double()).norm() / ref.double().norm() < 2e-3
    assert calls == []
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    assert calls == [1]
    monkeypatch.setenv(fp8t.ENV, "0")
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    assert calls == [1]


def test_fp8t_config_refuses_bad_tiles(monkeypatch):
    monkeypatch.setenv(fp8t.CONFIG_ENV, "block_n=96")
    with pytest.raises(ValueError, match="block_n"):
        fp8t.config()
    monkeypatch.setenv(fp8t.CONFIG_ENV, "bogus=1")
    with pytest.raises(ValueError, match="HWKV_CUDA_FP8T_CONFIG"):
        fp8t.config()

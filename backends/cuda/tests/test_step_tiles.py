"""Attention tiles chosen by the step's shape: a step of many tokens whose q blocks are mostly decodes takes
64-row tiles (hwkv_cuda.tiles.choose_config, ``short``); prefill-heavy steps keep 128 rows; an override wins."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda.attention import CudaAttentionMetadata  # noqa: E402

from hwkv.interfaces.attention import AttentionMetadata  # noqa: E402

BF16 = torch.bfloat16


def _tiles(qlens, slens, num_heads=32, num_kv_heads=8, head_size=64, dtype=BF16):
    bs = 16
    width = -(-max(slens) // bs)
    tables = torch.arange(len(qlens) * width, dtype=torch.int32).view(len(qlens), width)
    md = CudaAttentionMetadata(AttentionMetadata.build(qlens, slens, tables, bs, device="cpu"), num_sms=132)
    return md, md.launch(num_heads, num_kv_heads, head_size, dtype, True)[0]


def test_mostly_decodes_take_64_rows(monkeypatch):
    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    md, cfg = _tiles([1] * 224 + [512], [600] * 224 + [512])  # the probe's mixed step (1B: G = 4)
    assert md.mostly_short(32) and (cfg.block_m, cfg.block_q) == (64, 16)
    # prefill-heavy steps (the offline run's admission steps) and prefills alone keep 128-row tiles
    md, cfg = _tiles([1] * 32 + [512] * 31, [600] * 32 + [512] * 31)
    assert not md.mostly_short(32) and (cfg.block_m, cfg.block_q) == (128, 32)
    assert _tiles([512] * 32, [512] * 32)[1].block_m == 128
    # exactly half the q blocks short is not "mostly"
    md, cfg = _tiles([1] * 16 + [512], [600] * 16 + [512])
    assert not md.mostly_short(32) and cfg.block_m == 128
    # decodes alone keep the decode tiles (one token per program)
    assert _tiles([1] * 256, [640] * 256)[1].block_q == 1


def test_short_tiles_respect_the_group_and_overrides(monkeypatch):
    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    # a group of 16 (64 heads over 4 KV heads): 64 rows are 4 tokens of 16 heads
    _, cfg = _tiles([1] * 64 + [256], [300] * 64 + [256], num_heads=64, num_kv_heads=4, head_size=64)
    assert cfg.block_m == 64 and cfg.block_m // cfg.block_q >= 16
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG", "block_m=128,block_q=32")
    _, cfg = _tiles([1] * 224 + [512], [600] * 224 + [512])
    assert (cfg.block_m, cfg.block_q) == (128, 32)


def test_one_token_steps_skip_the_request_search():
    """A pure decode maps program i to request i (``one_token``); a decode launch must not take that shortcut when
    some request has another query length."""
    assert _tiles([1] * 8, [40] * 8)[0].one_token
    assert not _tiles([1] * 7 + [3], [40] * 8)[0].one_token


def test_a_full_unsplit_decode_grid_takes_one_warp_tiles(monkeypatch):
    """A decode whose grid fills the GPU unsplit (256 requests x 8 KV heads on 132 SMs) at head size <= 64 over a
    16-bit cache runs one warp over 64-key tiles on the head-major grid, at head 128 two warps; a split grid (batch
    4), an fp8 cache and a prefill keep their tiles, and an override wins."""
    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG", raising=False)
    monkeypatch.delenv("HWKV_CUDA_ATTN_CONFIG_DECODE", raising=False)
    md, cfg = _tiles([1] * 256, [640] * 256)
    plan = md.launch(32, 8, 64, BF16, True)[1]
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.head_major, plan.splits) == (64, 1, 3, 1, 1)
    md, cfg = _tiles([1] * 4, [4096] * 4)  # split: the split tiles, four warps
    assert md.launch(32, 8, 64, BF16, True)[1].splits > 1 and (cfg.num_warps, cfg.head_major) == (4, 0)
    # head 128 unsplit: two warps over the 64-key tiles (H200: a tp=2 rank of Llama-3-8B 72.4 -> 47.8 us a layer at
    # 128 x 600, tp=1's heads 111.8 -> 84.3); an fp8 cache keeps four (below)
    assert (lambda c: (c.block_n, c.num_warps, c.head_major))(_tiles([1] * 256, [640] * 256, head_size=128)[1]) \
        == (64, 2, 0)
    assert _tiles([1] * 128, [600] * 128, num_heads=16, num_kv_heads=4, head_size=128)[1].num_warps == 2
    fp8 = _tiles([1] * 256, [640] * 256)[0].launch(32, 8, 64, BF16, True, torch.float8_e4m3fn)[0]
    assert fp8.num_warps == 4
    assert _tiles([512] * 32, [512] * 32)[1].num_warps != 1
    monkeypatch.setenv("HWKV_CUDA_ATTN_CONFIG_DECODE", "block_n=128,num_warps=4")
    assert (lambda c: (c.block_n, c.num_warps))(_tiles([1] * 256, [640] * 256)[1]) == (128, 4)

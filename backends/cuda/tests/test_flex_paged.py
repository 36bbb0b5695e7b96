"""The bench's paged FlexAttention peer reads hwkv's interleaved paged cache correctly (CPU: eager and compiled)."""

import argparse
import shutil

import pytest
import torch
from hwkv_cuda.bench.flex_paged import paged_flex_args

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _naive(q, kv, tables, seq_len):
    """q [B, H, T, D]; gathers each request's pages into contiguous K/V, causal lower-right."""
    b, h, t, d = q.shape
    bs, hkv = kv.shape[2], kv.shape[3]
    pages = -(-seq_len // bs)
    out = torch.empty_like(q)
    for i in range(b):
        blocks = kv[tables[i, :pages].long()]  # [pages, 2, bs, hkv, d]
        k = blocks[:, 0].reshape(-1, hkv, d)[:seq_len].transpose(0, 1).repeat_interleave(h // hkv, 0)
        v = blocks[:, 1].reshape(-1, hkv, d)[:seq_len].transpose(0, 1).repeat_interleave(h // hkv, 0)
        s = q[i].double() @ k.double().transpose(1, 2) * d**-0.5
        pos = torch.arange(seq_len)[None, :] <= (seq_len - t + torch.arange(t))[:, None]
        out[i] = (s.masked_fill(~pos, float("-inf")).softmax(-1) @ v.double()).to(q.dtype)
    return out


@pytest.mark.parametrize("batch,h,hkv,q_len,seq_len,bs", [
    (3, 8, 2, 1, 37, 16),    # decode, ragged last page, GQA 4
    (2, 4, 4, 20, 50, 16),   # prefill chunk on a prefix: causal partial pages, q blocks of 16
    (2, 4, 1, 1, 64, 32),    # decode, whole pages only (all full blocks), MQA, block 32
])
def test_paged_flex_matches_naive(batch, h, hkv, q_len, seq_len, bs):
    torch.manual_seed(seq_len)
    d, pages = 16, -(-seq_len // bs)
    nb = 2 * batch * pages + 3  # pages of no request in between: the masks must skip them
    kv = torch.randn(nb, 2, bs, hkv, d)
    tables = torch.randperm(nb)[: batch * pages].view(batch, pages).to(torch.int32)
    q = torch.randn(batch, h, q_len, d)
    a = paged_flex_args(kv, tables, q_len, seq_len)
    ref = _naive(q, kv, tables, seq_len)
    # eager flex applies mask_mod everywhere and ignores the block lists ...
    out = flex.flex_attention(q, a["k"], a["v"], block_mask=a["block_mask"], enable_gqa=h != hkv)
    assert (out - ref).abs().max() < 1e-4
    # ... compiled flex visits only the listed blocks (CPU inductor wants the lists as wide as the KV)
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("compiled FlexAttention on the CPU needs a C++ compiler (checked the mask_mod only)")
    m, n = a["block_mask"], -(-a["k"].shape[2] // bs)
    pad = lambda x: torch.nn.functional.pad(x, (0, n - x.shape[-1]))  # noqa: E731
    wide = flex.BlockMask.from_kv_blocks(m.kv_num_blocks, pad(m.kv_indices), m.full_kv_num_blocks,
                                         pad(m.full_kv_indices), BLOCK_SIZE=m.BLOCK_SIZE, mask_mod=m.mask_mod,
                                         seq_lengths=m.seq_lengths, compute_q_blocks=False)
    out = torch.compile(flex.flex_attention, dynamic=False)(q, a["k"], a["v"], block_mask=wide, enable_gqa=h != hkv)
    assert (out - ref).abs().max() < 1e-4


def test_paged_flex_rejects_other_layouts():
    with pytest.raises(ValueError, match="contiguous"):
        paged_flex_args(torch.randn(4, 16, 2, 2, 8), torch.zeros(1, 1, dtype=torch.int32), 1, 8)


def test_bench_rejects_unknown_peers(capsys):
    from hwkv_cuda.bench import attention

    ap = argparse.ArgumentParser()
    attention.add_arguments(ap)
    assert attention.run(ap.parse_args(["--peers", "sdpa,flexx"])) == 2
    assert "unknown --peers flexx: choose from sdpa, flex, flex-paged" in capsys.readouterr().err

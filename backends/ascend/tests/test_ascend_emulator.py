"""The emulator itself enforces the documented op contracts (so the glue tests mean something)."""

from __future__ import annotations

import pytest
import torch


def fia_args(t=6, num_heads=4, nkv=2, d=64, dtype=torch.float16):
    q = torch.randn(t, num_heads, d).to(dtype)
    k = torch.randn(t, nkv, d).to(dtype)
    v = torch.randn(t, nkv, d).to(dtype)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)
    kw = dict(atten_mask=mask, block_table=None, input_layout="TND", block_size=128,
              actual_seq_lengths=[2, t], actual_seq_lengths_kv=[2, t], num_key_value_heads=nkv,
              num_heads=num_heads, scale=0.1, sparse_mode=3)
    return q, k, v, kw


def test_fia_rejects_non_contiguous_query(emulator):
    q, k, v, kw = fia_args()
    q_nc = torch.randn(4, 6, 64).to(torch.float16).transpose(0, 1)
    assert not q_nc.is_contiguous()
    with pytest.raises(RuntimeError, match="query: non-contiguous"):
        emulator.npu_fused_infer_attention_score(query=q_nc, key=k, value=v, **kw)


def test_fia_rejects_query_lengths_that_do_not_sum_to_token_count(emulator):
    q, k, v, kw = fia_args()
    kw["actual_seq_lengths"] = [2, 5]  # 5 != 6 query rows
    with pytest.raises(RuntimeError, match=r"actual_seq_lengths\[-1\] \(5\) must equal the query token count 6"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **kw)
    kw["actual_seq_lengths"] = [4, 2, 6]  # not cumulative
    with pytest.raises(RuntimeError, match="must be cumulative"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **kw)


def test_fia_length_list_rules(emulator):
    q, k, v, kw = fia_args()
    with pytest.raises(RuntimeError, match="actual_seq_lengths_kv has 1 entries, batch"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **{**kw, "actual_seq_lengths_kv": [6]})
    with pytest.raises(TypeError, match="list of ints"):
        emulator.npu_fused_infer_attention_score(
            query=q, key=k, value=v, **{**kw, "actual_seq_lengths": torch.tensor([2, 6])}
        )
    with pytest.raises(RuntimeError, match=r"actual_seq_lengths_kv\[-1\]"):  # raw K/V: cumulative kv ends
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **{**kw, "actual_seq_lengths_kv": [2, 4]})


def test_fia_signature_dtype_and_mask(emulator):
    q, k, v, kw = fia_args()
    with pytest.raises(TypeError):  # everything after value is keyword-only
        emulator.npu_fused_infer_attention_score(q, k, v, kw["atten_mask"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'scale_value'"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, scale_value=0.1)
    with pytest.raises(RuntimeError, match="float16/bfloat16"):
        emulator.npu_fused_infer_attention_score(query=q.float(), key=k.float(), value=v.float(), **kw)
    lower = kw["atten_mask"].T.contiguous()
    with pytest.raises(RuntimeError, match="upper-triangular"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **{**kw, "atten_mask": lower})
    small = kw["atten_mask"][:6, :6].contiguous()
    with pytest.raises(RuntimeError, match="2048"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **{**kw, "atten_mask": small})
    with pytest.raises(NotImplementedError, match="TND only"):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **{**kw, "input_layout": "BSH"})


def test_fia_paged_needs_block_size_128_multiple_and_int32_table(emulator):
    q, _, _, kw = fia_args()
    kc = torch.zeros(4, 64, 2 * 64, dtype=torch.float16)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    paged = {**kw, "block_table": bt, "block_size": 64, "actual_seq_lengths_kv": [2, 10]}
    with pytest.raises(RuntimeError, match="multiple of 128"):
        emulator.npu_fused_infer_attention_score(query=q, key=kc, value=kc, **paged)
    kc = torch.zeros(4, 128, 2 * 64, dtype=torch.float16)
    paged["block_size"] = 128
    with pytest.raises(RuntimeError, match="int32"):
        emulator.npu_fused_infer_attention_score(query=q, key=kc, value=kc, **{**paged, "block_table": bt.long()})
    out, lse = emulator.npu_fused_infer_attention_score(query=q, key=kc, value=kc, **paged)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (1,)


def test_fia_right_down_causal_and_fully_masked_rows(emulator):
    """sparse_mode=3 aligns the causal diagonal to the bottom-right: query row i sees kv j <= i + (kv - q)."""
    d = 64
    q = torch.randn(3, 1, d).to(torch.float16)
    k = torch.randn(5, 1, d).to(torch.float16)
    v = torch.randn(5, 1, d).to(torch.float16)
    kc = torch.zeros(1, 128, d, dtype=torch.float16)
    kc[0, :5], vc = k[:, 0], torch.zeros(1, 128, d, dtype=torch.float16)
    vc[0, :5] = v[:, 0]
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)
    out, _ = emulator.npu_fused_infer_attention_score(
        query=q, key=kc, value=vc, atten_mask=mask, block_table=torch.zeros(1, 1, dtype=torch.int32),
        input_layout="TND", block_size=128, actual_seq_lengths=[3], actual_seq_lengths_kv=[5],
        num_key_value_heads=1, num_heads=1, scale=1.0, sparse_mode=3)
    # row 0 sits at position 2 (kv 5 - q 3): it sees kv 0..2
    s = (k[:3, 0].float() @ q[0, 0].float()).softmax(0)
    torch.testing.assert_close(out[0, 0].float(), s @ v[:3, 0].float(), atol=2e-3, rtol=5e-3)


def test_scatter_rejects_non_contiguous_and_skips_minus_one_only_on_a3_cann9(emulator):
    kc = torch.zeros(2, 128, 2, 16, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 16).to(torch.float16)
    v = torch.randn(3, 2, 16).to(torch.float16)
    slots = torch.tensor([5, -1, 130])
    k_nc = torch.randn(2, 3, 16).to(torch.float16).transpose(0, 1)
    a2, a3 = emulator.make_module(), emulator.make_module(soc_version=252)
    with pytest.raises(RuntimeError, match="key: non-contiguous"):
        a3.npu_scatter_pa_kv_cache(key=k_nc, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots,
                                   cache_mode="Norm")
    with pytest.raises(NotImplementedError, match="cache_mode='Norm'"):  # the op defaults to PA_NZ
        a3.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots)
    with pytest.raises(RuntimeError, match="unique"):
        a3.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kc, value_cache=vc,
                                   slot_mapping=torch.tensor([5, 5, 6]), cache_mode="Norm")
    with pytest.raises(RuntimeError, match=r"\[0, 256\)"):
        a3.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kc, value_cache=vc,
                                   slot_mapping=torch.tensor([5, 6, 256]), cache_mode="Norm")
    for mod in (a2, emulator.make_module(soc_version=252, cann="8.3.RC1")):  # the skip is unconfirmed there
        with pytest.raises(RuntimeError, match="negative slots are skipped only on A3 with CANN >= 9"):
            mod.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots,
                                        cache_mode="Norm")
    assert not bool(kc.any())
    a3.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=slots, cache_mode="Norm")
    assert torch.equal(kc[0, 5], k[0]) and torch.equal(kc[1, 2], k[2]) and torch.equal(vc[1, 2], v[2])
    assert int((kc != 0).any(dim=(2, 3)).sum()) == 2  # the -1 token wrote nothing


def test_torch_npu_2_9_scatter_has_no_cache_mode(emulator):
    """torch_npu 2.8/2.9: the keyword does not exist, so every ND KV write is a TypeError."""
    import inspect

    old = emulator.make_module(version="2.9.0")
    assert "cache_mode" not in inspect.signature(old.npu_scatter_pa_kv_cache).parameters
    assert "cache_mode" in inspect.signature(emulator.make_module().npu_scatter_pa_kv_cache).parameters
    kc = torch.zeros(1, 128, 1, 64, dtype=torch.float16)
    k = torch.randn(1, 1, 64).to(torch.float16)
    with pytest.raises(TypeError, match=r"npu_scatter_pa_kv_cache\(\) got an unexpected keyword argument 'cache_mode'"):
        old.npu_scatter_pa_kv_cache(key=k, value=k, key_cache=kc, value_cache=kc,
                                    slot_mapping=torch.tensor([0]), cache_mode="Norm")


@pytest.mark.parametrize("d", [16, 32, 80, 96, 256])
def test_fia_tnd_refuses_head_dims_outside_64_128_192_with_the_ops_text(emulator, d):
    q, k, v, kw = fia_args(d=d)
    text = f"input_layout is TND, only headDim = 64/128/192 are supported, but got {d}$"
    with pytest.raises(RuntimeError, match=text):
        emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **kw)


@pytest.mark.parametrize("d", [64, 128, 192])
def test_fia_tnd_takes_64_128_192(emulator, d):
    q, k, v, kw = fia_args(d=d)
    out, _ = emulator.npu_fused_infer_attention_score(query=q, key=k, value=v, **kw)
    assert out.shape == q.shape


def test_fia_paged_tnd_needs_cann_9(emulator):
    q, _, _, kw = fia_args()
    kc = torch.zeros(4, 128, 2 * 64, dtype=torch.float16)
    paged = {**kw, "block_table": torch.tensor([[0], [1]], dtype=torch.int32), "actual_seq_lengths_kv": [2, 10]}
    old = emulator.make_module(cann="8.3.RC1")
    with pytest.raises(RuntimeError, match="CANN 8.3.RC1: input_layout TND does not support page attention"):
        old.npu_fused_infer_attention_score(query=q, key=kc, value=kc, **paged)
    emulator.make_module().npu_fused_infer_attention_score(query=q, key=kc, value=kc, **paged)


def test_paged_attention_argument_rules(emulator):
    q = torch.randn(2, 4, 64).to(torch.float16)
    kc = torch.zeros(3, 128, 2, 64, dtype=torch.float16)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    ok = dict(query=q, key_cache=kc, value_cache=kc, num_kv_heads=2, num_heads=4, scale_value=1.0,
              block_table=bt, context_lens=torch.tensor([3, 4], dtype=torch.int32), out=torch.empty_like(q))
    emulator._npu_paged_attention(**ok)
    with pytest.raises(RuntimeError, match="context_lens must be int32"):
        emulator._npu_paged_attention(**{**ok, "context_lens": torch.tensor([3, 4])})
    with pytest.raises(RuntimeError, match="block_size \\* head_size <= 128 \\* 128"):
        big = torch.zeros(3, 128, 2, 256, dtype=torch.float16)
        q256 = torch.randn(2, 4, 256).to(torch.float16)
        emulator._npu_paged_attention(**{**ok, "query": q256, "key_cache": big, "value_cache": big,
                                         "out": torch.empty_like(q256)})
    with pytest.raises(RuntimeError, match="context_lens\\[1\\]=200"):
        emulator._npu_paged_attention(**{**ok, "context_lens": torch.tensor([3, 200], dtype=torch.int32)})


def test_fia_band_keeps_pre_tokens_before_and_next_tokens_after(emulator):
    """sparse_mode=4 [FIA-band]: right-down aligned, a query at p keeps kv [p - pre_tokens, p + next_tokens];
    the bounds mean nothing in mode 3; a band in mode 0 and negative bounds are not emulated."""
    d = 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 1, d, generator=g).to(torch.float16)
    k = torch.randn(9, 1, d, generator=g).to(torch.float16)
    v = torch.randn(9, 1, d, generator=g).to(torch.float16)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1)
    kw = dict(query=q, key=k, value=v, atten_mask=mask, input_layout="TND", actual_seq_lengths=[3],
              actual_seq_lengths_kv=[9], num_key_value_heads=1, num_heads=1, scale=1.0)
    out, _ = emulator.npu_fused_infer_attention_score(**kw, sparse_mode=4, pre_tokens=2, next_tokens=0)
    for i in range(3):  # row i sits at position 6 + i: it keeps kv 4 + i .. 6 + i
        s = (k[4 + i : 7 + i, 0].float() @ q[i, 0].float()).softmax(0)
        torch.testing.assert_close(out[i, 0].float(), s @ v[4 + i : 7 + i, 0].float(), atol=2e-3, rtol=5e-3)
    causal, _ = emulator.npu_fused_infer_attention_score(**kw, sparse_mode=3, pre_tokens=2, next_tokens=0)
    wide, _ = emulator.npu_fused_infer_attention_score(**kw, sparse_mode=4, pre_tokens=8, next_tokens=0)
    assert torch.equal(causal, wide) and not torch.equal(causal, out)
    with pytest.raises(NotImplementedError, match="sparse_mode=0"):
        emulator.npu_fused_infer_attention_score(**{**kw, "atten_mask": None}, sparse_mode=0, pre_tokens=2)
    with pytest.raises(NotImplementedError, match="negative band"):
        emulator.npu_fused_infer_attention_score(**kw, sparse_mode=4, pre_tokens=2, next_tokens=-1)

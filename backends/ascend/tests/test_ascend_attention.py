"""Ascend attention glue on the emulated ops vs an independent naive attention, all four states."""

from __future__ import annotations

import pytest
import torch

from hwkv.interfaces import AttentionMetadata, KVCacheSpec, KVLayoutKind
from hwkv.testing.paged import random_block_tables

BS = 128
# (context_len, query_len) per request, the state the builder must pick
SCENARIOS = {
    "prefill_no_cache": [(0, 5), (0, 130), (0, 17)],
    "prefill_cache_hit": [(128, 7), (3, 200), (250, 6)],
    "decode_only": [(5, 1), (127, 1), (300, 1)],
    "chunked_prefill": [(0, 40), (130, 1), (20, 100), (256, 1)],
}
HEADS = [(4, 4), (8, 2), (4, 1)]  # MHA, GQA 4, MQA
TOL = {torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.6e-2, 2e-2)}  # the conformance suite's table


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q [Sq, N, D] at positions start.., k/v [S, Nkv, D] (whole sequence), causal (and a query at p sees
    only keys in (p - window, p]); float64 softmax."""
    n, nkv = q.shape[1], k.shape[1]
    k = k.double()[:, torch.arange(n) // (n // nkv)]  # query head h reads KV head h // group
    v = v.double()[:, torch.arange(n) // (n // nkv)]
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    pos = start + torch.arange(q.shape[0])
    scores[:, torch.arange(k.shape[0])[None, :] > pos[:, None]] = float("-inf")
    if window is not None:
        scores[:, torch.arange(k.shape[0])[None, :] <= pos[:, None] - window] = float("-inf")
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v)


def physical_slots(table: list[int], lo: int, hi: int) -> torch.Tensor:
    pos = torch.arange(lo, hi)
    return torch.tensor(table, dtype=torch.long)[pos // BS] * BS + pos % BS


def make_case(reqs, num_heads, num_kv_heads, head_size, dtype, seed=0):
    """Random per-request sequences, shuffled physical blocks, the context already in the cache."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    tables, num_blocks = random_block_tables(seq_lens, BS, g)
    k_full = [torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype) for s in seq_lens]
    v_full = [torch.randn(s, num_kv_heads, head_size, generator=g).to(dtype) for s in seq_lens]
    q_new = [torch.randn(q, num_heads, head_size, generator=g).to(dtype) for _, q in reqs]
    spec = KVCacheSpec(1, num_blocks, BS, num_kv_heads, head_size, dtype)
    kc, vc = (torch.zeros(s, dtype=dtype) for s in spec.tensor_shapes(KVLayoutKind.SEPARATE_KV))
    for (ctx, _), tab, kf, vf in zip(reqs, tables, k_full, v_full):
        slots = physical_slots(tab, 0, ctx)  # the cached prefix, written independently of the backend
        kc.view(-1, num_kv_heads, head_size)[slots] = kf[:ctx]
        vc.view(-1, num_kv_heads, head_size)[slots] = vf[:ctx]
    md = AttentionMetadata.build([q for _, q in reqs], seq_lens, tables, BS)
    new_k = torch.cat([kf[c:] for (c, _), kf in zip(reqs, k_full)])
    new_v = torch.cat([vf[c:] for (c, _), vf in zip(reqs, v_full)])
    return md, torch.cat(q_new), new_k, new_v, (kc, vc), k_full, v_full, tables


def expected(reqs, q, k_full, v_full, scale, window=None):
    outs, at = [], 0
    for (ctx, ql), kf, vf in zip(reqs, k_full, v_full):
        outs.append(naive_attention(q[at : at + ql], kf, vf, ctx, scale, window))
        at += ql
    return torch.cat(outs)


@pytest.mark.parametrize("state", list(SCENARIOS))
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_size", [64, 192], ids=lambda d: f"hd{d}")  # 192: decode through FIA
def test_attention_states_match_naive(npu, state, heads, dtype, head_size):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    num_heads, num_kv_heads = heads
    scale = head_size**-0.5
    reqs = SCENARIOS[state]
    md, q, new_k, new_v, kv, k_full, v_full, tables = make_case(reqs, num_heads, num_kv_heads, head_size, dtype)
    impl = backend.attention.make_impl(num_heads, head_size, num_kv_heads, scale)
    amd = backend.attention.metadata_builder().build(md)
    assert amd.state.value == state

    impl.write_kv(new_k, new_v, kv, md.slot_mapping)
    for (ctx, ql), tab, kf, vf in zip(reqs, tables, k_full, v_full):  # the write is bit exact
        slots = physical_slots(tab, ctx, ctx + ql)
        assert torch.equal(kv[0].view(-1, num_kv_heads, head_size)[slots], kf[ctx:])
        assert torch.equal(kv[1].view(-1, num_kv_heads, head_size)[slots], vf[ctx:])

    out = impl.forward(q, new_k, new_v, kv, amd)
    assert out.shape == q.shape and out.dtype == dtype
    atol, rtol = TOL[dtype]
    ref = expected(reqs, q, k_full, v_full, scale)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)


def test_non_contiguous_query_is_made_contiguous(npu):
    """Models hand over q as a view of the fused qkv projection; the ops refuse such tensors."""
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    reqs = SCENARIOS["chunked_prefill"]
    md, q, new_k, new_v, kv, k_full, v_full, _ = make_case(reqs, 8, 2, 64, torch.float16, seed=1)
    qkv = torch.cat([q.reshape(q.shape[0], -1), new_k.reshape(q.shape[0], -1), new_v.reshape(q.shape[0], -1)], 1)
    q_view = qkv[:, : 8 * 64].view(-1, 8, 64)
    k_view = qkv[:, 8 * 64 : 10 * 64].view(-1, 2, 64)
    v_view = qkv[:, 10 * 64 :].view(-1, 2, 64)
    assert not q_view.is_contiguous()
    impl = backend.attention.make_impl(8, 64, 2, 64**-0.5)
    amd = backend.attention.metadata_builder().build(md)
    impl.write_kv(k_view, v_view, kv, md.slot_mapping)
    out = impl.forward(q_view, k_view, v_view, kv, amd)
    torch.testing.assert_close(out.double(), expected(reqs, q, k_full, v_full, 64**-0.5), atol=2e-3, rtol=5e-3)


@pytest.mark.parametrize("state", list(SCENARIOS))
@pytest.mark.parametrize("window", [1, 13, 128], ids=lambda w: f"w{w}")
def test_window_through_fia_band_matches_naive(npu, monkeypatch, state, window):
    """A window layer runs FIA's band mode (sparse_mode=4, pre_tokens = window - 1, next_tokens = 0) in
    every state, decode included (ATB PagedAttention has no window, and is not called)."""
    import torch_npu
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    assert backend.capabilities.attention_features == ("sliding_window",)
    calls = []
    real = torch_npu.npu_fused_infer_attention_score
    monkeypatch.setattr(torch_npu, "npu_fused_infer_attention_score", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setattr(torch_npu, "_npu_paged_attention", None)  # a call would fail
    reqs = SCENARIOS[state]
    md, q, new_k, new_v, kv, k_full, v_full, _ = make_case(reqs, 8, 2, 64, torch.float16, seed=2)
    impl = backend.attention.make_impl(8, 64, 2, 64**-0.5)
    impl.window = window
    amd = backend.attention.metadata_builder().build(md)
    impl.write_kv(new_k, new_v, kv, md.slot_mapping)
    out = impl.forward(q, new_k, new_v, kv, amd)
    assert [(c["sparse_mode"], c["pre_tokens"], c["next_tokens"]) for c in calls] == [(4, window - 1, 0)]
    torch.testing.assert_close(out.double(), expected(reqs, q, k_full, v_full, 64**-0.5, window), atol=2e-3,
                               rtol=5e-3)
    if window < 128:  # the window matters here: the causal answer differs
        assert not torch.allclose(out.double(), expected(reqs, q, k_full, v_full, 64**-0.5), atol=2e-3, rtol=5e-3)


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
def test_softcap_and_sinks_refused_by_name(npu, feature):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    spec = KVCacheSpec(1, 4, BS, 2, 64, torch.float16)
    need = {"softcap": "logit_softcap", "sinks": "attention_sinks"}[feature]
    (why,) = backend.capabilities.validate(spec, 8, attention_features=(need,))
    assert why.startswith(f"attention feature {need} not supported (supported: sliding_window)")
    assert "no logit soft-cap and no attention-sink input" in why
    md, q, new_k, new_v, kv, *_ = make_case(SCENARIOS["decode_only"], 8, 2, 64, torch.float16)
    impl = backend.attention.make_impl(8, 64, 2, 64**-0.5)
    setattr(impl, feature, 8.0 if feature == "softcap" else torch.zeros(8))
    with pytest.raises(ValueError, match="the Ascend attention ops take no"):
        impl.forward(q, new_k, new_v, kv, backend.attention.metadata_builder().build(md))

"""Per-layer attention parameters (sliding window, logit soft-cap, sinks): the reference backend
against a dense per-request formula, and the capability refusal of backends that lack them."""

from __future__ import annotations

import pytest
import torch

from hwkv.interfaces.attention import AttentionMetadata
from hwkv.interfaces.capabilities import Capabilities
from hwkv.interfaces.layout import KVCacheSpec
from hwkv.reference.attention import ReferenceAttentionBackend


def dense(q, k, v, ctx, scale, window, softcap, sinks):
    """One request: q [Q, H, D] at positions ctx.., k/v [S, H_kv, D] — the textbook formula."""
    h, hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.double() * scale, k.double())
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(q.shape[0])[:, None] + ctx
    kpos = torch.arange(k.shape[0])[None]
    ok = kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
    s = s.masked_fill(~ok, float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    den = e.sum(-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks.double()[:, None, None] - s.amax(-1, keepdim=True))
    return torch.einsum("hqk,khd->qhd", e / den, v.double())


@pytest.mark.parametrize("window,softcap,with_sinks", [(5, None, False), (None, 3.0, False), (None, None, True),
                                                       (4, 2.0, True), (1, None, False)])
def test_reference_features_match_dense(window, softcap, with_sinks):
    torch.manual_seed(0)
    h, hkv, d, bs, nb = 4, 2, 8, 4, 32
    impl = ReferenceAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.window, impl.softcap = window, softcap
    impl.sinks = torch.randn(h) if with_sinks else None
    cache = torch.full((nb, 2, bs, hkv, d), float("nan"))
    # (cached context, query length): decode, chunk on a cached prefix, fresh prefill
    reqs = [(9, 1), (6, 7), (0, 13)]
    tables, kv, qs = [], [], []
    nxt = 0
    for ctx, ql in reqs:
        n = -(-(ctx + ql) // bs)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
        kv.append((torch.randn(ctx + ql, hkv, d), torch.randn(ctx + ql, hkv, d)))
        qs.append(torch.randn(ql, h, d))
    md = AttentionMetadata.build([ql for _, ql in reqs], [c + q for c, q in reqs], tables, bs)
    all_slots = AttentionMetadata.build([c + q for c, q in reqs], [c + q for c, q in reqs], tables, bs).slot_mapping
    impl.write_kv(torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), cache, all_slots)
    q = torch.cat(qs)
    out = impl.forward(q, q[:, :hkv], q[:, :hkv], cache, md)
    start = 0
    for (ctx, ql), (k, v), qr in zip(reqs, kv, qs):
        want = dense(qr, k, v, ctx, d**-0.5, window, softcap, impl.sinks)
        torch.testing.assert_close(out[start:start + ql].double(), want, atol=1e-5, rtol=1e-5)
        start += ql


def test_missing_feature_refused_by_name():
    spec = KVCacheSpec(num_layers=1, num_blocks=1, block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    caps = Capabilities(attention_features=("sliding_window",), attention_features_reason="no tanh in the kernel")
    assert caps.validate(spec, attention_features=("sliding_window",)) == []
    (why,) = caps.validate(spec, attention_features=("sliding_window", "logit_softcap"))
    assert why == "attention feature logit_softcap not supported (supported: sliding_window); no tanh in the kernel"
    assert "unknown attention feature 'alibi'" in caps.validate(spec, attention_features=("alibi",))[0]


def test_engine_refuses_windowed_model_on_backend_without_windows(tmp_path):
    from hwkv.engine.kv_alloc import check_backend
    from hwkv.model import load_model
    from hwkv.model.tiny import write_tiny_model
    from hwkv.reference.backend import CpuBackend

    write_tiny_model(tmp_path, "mistral", sliding_window=8, tokenizer=False)
    be = CpuBackend()
    model, _, _, _ = load_model(tmp_path, be, load_tokenizer=False)
    assert model.attention_features == ("sliding_window",)
    check_backend(be, model, 16)  # the reference computes windows
    be._caps = Capabilities(attention_features_reason="kernel X has no window mask")
    with pytest.raises(ValueError, match="attention feature sliding_window not supported .*kernel X has no window"):
        check_backend(be, model, 16)

"""The Gluon fp8-KV decode kernel (hwkv_cuda.attention_fp8g, the default fp8 decode where it applies) against the
reference oracle over the same fp8 cache: one split and several, GQA 4 / 8 and MHA, head 64 and 128, partial last
tiles and blocks, empty splits, both 16-bit query dtypes. Gluon has no interpreter: the kernel runs on a GPU only;
on a CPU the route is never taken, which the routing test checks there."""

import pytest
import torch

pytest.importorskip("triton")

from hwkv_cuda import attention_fp8g as fp8g  # noqa: E402
from hwkv_cuda.attention import TritonAttentionBackend  # noqa: E402
from naive import paged_case  # noqa: E402
from test_fp8_kv import DEV, _fp8_cache, _scales  # noqa: E402

from hwkv.interfaces.attention import AttentionMetadata  # noqa: E402
from hwkv.reference.attention import paged_attention  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="Gluon kernels need a CUDA GPU (no interpreter)")


@GPU
@pytest.mark.parametrize("qdtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", [(8, 2, 64), (32, 8, 64), (16, 2, 128), (4, 4, 64)], ids=["gqa4", "1b", "gqa8_d128",
                                                                                         "mha"])
@pytest.mark.parametrize("splits", ["splits=1", "min_split=128", "splits=5", "stages=2,min_split=128"])
def test_fp8g_decode_equals_the_reference(splits, shape, qdtype, monkeypatch):
    monkeypatch.delenv(fp8g.ENV, raising=False)  # on by default
    monkeypatch.setenv(fp8g.CONFIG_ENV, splits + ",min_keys=0")  # these decodes are smaller than it takes by default
    calls = []
    real = fp8g.forward_fp8g

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(fp8g, "forward_fp8g", spy)
    h, hkv, d = shape
    bs = 16
    qlens, slens = [1, 1, 1, 1], [70, 900, 130, 16]  # partial last tiles and blocks, a one-block request
    q, kv, md, _ = paged_case(qlens, slens, h, hkv, d, bs, seed=h * d + hkv, device=DEV)
    scales = _scales(hkv, d)
    cache = _fp8_cache(kv / 0.05, scales)  # values ~ 20 / scale: the whole e4m3 range is used
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.kv_scales = scales
    built = TritonAttentionBackend().metadata_builder().build(md)
    qd = q.to(DEV, qdtype)
    out = torch.full_like(qd, float("nan"))
    impl.forward_into(out, qd, cache, built)
    assert calls == [1]
    ref = paged_attention(qd.float(), cache, md.query_start_loc_cpu, md.seq_lens_cpu, md.block_tables, d**-0.5,
                          kv_scales=scales)
    assert not out.isnan().any()
    err = (out.double() - ref.double()).norm() / ref.double().norm()
    # fp16 P in the P.V product (~2^-11 relative) and the output's own 16-bit rounding (bf16: 2^-9)
    assert err < (2e-3 if qdtype == torch.float16 else 5e-3), f"rel err {err:.2e}"
    impl.kv_scales = torch.ones_like(scales)  # the scales are really applied
    out1 = torch.empty_like(out)
    impl.forward_into(out1, qd, cache, built)
    assert (out1.double() - ref.double()).norm() / ref.double().norm() > 1e-2


def test_fp8g_takes_only_the_decodes_it_supports(monkeypatch):
    """Prefill steps, 16-bit caches, fp32 queries, windowed layers, odd KV head counts, 8-token blocks and decodes
    under ``min_keys`` keep the unified kernel, as does a Triton without Gluon; ``HWKV_CUDA_FP8G=0`` turns the
    route off; on a CPU (the unified kernel under the interpreter) it is never taken."""
    calls = []
    monkeypatch.setattr(fp8g, "forward_fp8g", lambda *a, **k: calls.append(1))
    monkeypatch.delenv(fp8g.ENV, raising=False)
    monkeypatch.setenv(fp8g.CONFIG_ENV, "min_keys=100")
    h, hkv, d, bs = 8, 2, 64, 16
    q, kv, md, _ = paged_case([3, 1], [40, 70], h, hkv, d, bs, seed=3, device=DEV)  # a prefill chunk beside a decode
    scales = _scales(hkv, 3)
    cache = _fp8_cache(kv / 0.05, scales)
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    impl.kv_scales = scales
    b = TritonAttentionBackend().metadata_builder()
    impl.forward_into(torch.empty_like(q.to(DEV, torch.float16)), q.to(DEV, torch.float16), cache, b.build(md))
    dmd = b.build(AttentionMetadata.build([1, 1], [40, 70], md.block_tables, bs, device=DEV))  # 2 x 70 = 140 keys
    qd = q[:2].to(DEV, torch.float16)
    impl.forward_into(torch.empty_like(qd), qd.float(), cache, dmd)  # fp32 query
    impl.forward_into(torch.empty_like(qd), qd, kv.to(DEV, torch.float16), dmd)  # 16-bit cache
    impl.window = 16
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    impl.window = None
    assert calls == []
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    taken = [1] if DEV == "cuda" else []
    assert calls == taken
    monkeypatch.setenv(fp8g.CONFIG_ENV, "min_keys=141")  # one key more than the step has
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    assert calls == taken
    monkeypatch.setenv(fp8g.CONFIG_ENV, "min_keys=100")
    monkeypatch.setenv(fp8g.ENV, "0")
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    assert calls == taken
    monkeypatch.delenv(fp8g.ENV)
    gluon = fp8g.gluon_available
    monkeypatch.setattr(fp8g, "gluon_available", lambda: False)  # a Triton without the Gluon names it uses
    impl.forward_into(torch.empty_like(qd), qd, cache, dmd)
    assert calls == taken
    monkeypatch.setattr(fp8g, "gluon_available", gluon)
    q3, kv3, md3, _ = paged_case([1, 1], [40, 70], 6, 3, d, 8, seed=5, device=DEV)  # 3 KV heads, 8-token blocks
    impl3 = TritonAttentionBackend().make_impl(6, d, 3, d**-0.5)
    impl3.kv_scales = _scales(3, 5)
    q3d = q3.to(DEV, torch.float16)
    impl3.forward_into(torch.empty_like(q3d), q3d, _fp8_cache(kv3 / 0.05, impl3.kv_scales), b.build(md3))
    assert calls == taken


def test_fp8g_config_refuses_bad_stages(monkeypatch):
    monkeypatch.setenv(fp8g.CONFIG_ENV, "stages=1")
    with pytest.raises(ValueError, match="stages must be >= 2"):
        fp8g.config()
    monkeypatch.setenv(fp8g.CONFIG_ENV, "stagez=3")
    with pytest.raises(ValueError, match="stagez"):
        fp8g.config()


def test_fp8g_splits():
    """Whole waves by default (a negative target is a ceiling of programs per SM), a positive target rounds up,
    ``min_split`` and a fixed count, whole 32-key tiles and no empty split of the longest request."""
    from types import SimpleNamespace

    md = lambda reqs, max_len: SimpleNamespace(num_sms=132, common=SimpleNamespace(num_reqs=reqs, max_seq_len=max_len))
    assert fp8g.splits_for(md(32, 32768), 4, 32, -8, 512) == 8  # 1,024 programs on 132 x 8 places
    assert fp8g.splits_for(md(32, 32768), 4, 32, -7, 512) == 7  # 7 x 132 // 128
    assert fp8g.splits_for(md(32, 32768), 4, 32, 7, 512) == 8  # the ceiling of 7.2
    assert fp8g.splits_for(md(1, 1024), 4, 32, -8, 512) == 2  # one split per 512 keys at most
    assert fp8g.splits_for(md(32, 32768), 4, 32, -8, 512, fixed=5) == 5
    assert fp8g.splits_for(md(1, 100), 4, 32, -8, 1) == 4  # 25 keys a split rounded to a 32-key tile: 4 splits
    assert fp8g.resident(3, 128) == 8 and fp8g.resident(3, 256) == 4

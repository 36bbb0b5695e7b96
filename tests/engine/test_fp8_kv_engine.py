"""fp8 KV cache through the public API on the reference backend (the oracle): the option, its
validation, half the bytes per block, scales, generation with prefix-cache hits, and a clear refusal
from a backend that does not declare it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import hwkv
from hwkv.interfaces.kv_quant import FP8_E4M3, parse_scales
from hwkv.model.tiny import write_tiny_model

GREEDY = hwkv.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("fp8") / "m", max_position_embeddings=256,
                                dtype=torch.bfloat16))


def _prompts(n=4):
    return [[1 + (i * 7 + j * 3) % 400 for j in range(20 + 11 * i)] for i in range(n)]


def test_fp8_halves_block_bytes_and_generates(model_dir):
    auto = hwkv.Engine(model_dir, num_kv_blocks=64, dtype="bfloat16")
    fp8 = hwkv.Engine(model_dir, num_kv_blocks=64, dtype="bfloat16", kv_cache_dtype="fp8")
    assert auto.kv_cache.spec.dtype == torch.bfloat16 and fp8.kv_cache.spec.dtype == FP8_E4M3
    assert fp8.kv_cache.spec.bytes_per_block * 2 == auto.kv_cache.spec.bytes_per_block
    assert fp8.config.cache.kv_cache_dtype == "fp8"
    assert tuple(fp8.kv_cache.scales.shape) == (2, 2, 2) and bool((fp8.kv_cache.scales == 1).all())
    assert auto.kv_cache.scales is None and auto.kv_cache.format_key() == "bfloat16"
    assert fp8.kv_cache.format_key().startswith("fp8_e4m3-vt-s")
    # each layer's attention reads its own row of the cache's scales
    impls = [layer.self_attn.impl for layer in fp8.model.model.layers]
    assert impls[0] is not impls[1]
    assert impls[1].kv_scales.data_ptr() == fp8.kv_cache.scales[1].data_ptr()
    outs = fp8.generate(_prompts(), GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 12 for o in outs)
    # the prefix cache serves fp8 blocks like any other: same tokens, prompt blocks hit
    again = fp8.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert fp8.stats()["prefix_cache_hits"] > 0
    assert fp8.stats()["num_running"] == 0


def test_memory_sized_pool_holds_twice_the_blocks(model_dir, monkeypatch):
    from hwkv.reference.device import CpuDevice

    monkeypatch.setattr(CpuDevice, "memory_info", lambda self: (2**22, 2**27))  # 4 MiB free of 128 MiB
    kw = dict(dtype="bfloat16", memory_fraction=1.0, max_num_seqs=1024)
    n_auto = hwkv.Engine(model_dir, **kw).config.cache.num_kv_blocks
    n_fp8 = hwkv.Engine(model_dir, kv_cache_dtype="fp8", **kw).config.cache.num_kv_blocks
    assert n_auto < 16384 and n_fp8 == 2 * n_auto  # below the max_num_seqs cap: twice the blocks


def test_scales_are_applied(model_dir):
    scales = [[0.5, 0.25], [2.0, 1.0]]  # per layer: k, v
    e = hwkv.Engine(model_dir, num_kv_blocks=64, dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_scales=scales)
    want = torch.tensor(scales)[:, :, None].expand(2, 2, 2)
    assert torch.equal(e.kv_cache.scales, want)
    e.generate(_prompts(1), GREEDY, use_tqdm=False)
    # block 0 holds the first prompt's first tokens: K of layer 0 stored as k / 0.5, dequantised back
    k0 = e.kv_cache.layer(0)[0, 0].float() * 0.5
    assert k0.abs().sum() > 0
    one = hwkv.Engine(model_dir, num_kv_blocks=64, dtype="bfloat16", kv_cache_dtype="fp8")
    one.generate(_prompts(1), GREEDY, use_tqdm=False)
    k1 = one.kv_cache.layer(0)[0, 0].float()
    assert torch.allclose(k0, k1, rtol=2**-3, atol=2**-8)  # the same K, within e4m3 rounding


def test_bad_options_name_what_is_allowed(model_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3'\]"):
        hwkv.Engine(model_dir, num_kv_blocks=16, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_scales needs a quantised kv_cache_dtype"):
        hwkv.Engine(model_dir, num_kv_blocks=16, kv_cache_scales=0.5)
    for bad, msg in ((0.0, "finite and > 0"), ([1.0, 2.0, 3.0], r"shape \[3\]"), (float("nan"), "finite")):
        with pytest.raises(ValueError, match=msg):
            hwkv.Engine(model_dir, num_kv_blocks=16, kv_cache_dtype="fp8", kv_cache_scales=bad)
    assert tuple(parse_scales([[[1.0, 2.0], [3.0, 4.0]]] * 3, 3, 2).shape) == (3, 2, 2)


def test_backend_without_fp8_refuses_by_name(model_dir):
    from hwkv.reference.backend import CpuBackend

    b = CpuBackend()
    b._caps = replace(b._caps, kv_cache_dtypes=("auto",), kv_cache_dtype_reason="the kernels take no float8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8_e4m3 not supported \(allowed: auto\); "
                                         r"the kernels take no float8"):
        hwkv.Engine(model_dir, backend=b, num_kv_blocks=16, kv_cache_dtype="fp8")
    hwkv.Engine(model_dir, backend=b, num_kv_blocks=16)  # auto still runs


def test_ascend_declares_no_fp8_and_says_why():
    from hwkv_ascend.backend import KV_FP8_REFUSED

    assert "int8" in KV_FP8_REFUSED and "antiquant" in KV_FP8_REFUSED


def test_format_key_guards_pool_and_pd_exchanges():
    """Blocks move between engines only with equal format keys: the P/D handshake names the
    difference, pool keys differ; host mirrors share the device cache's scales."""
    from hwkv.connectors.p2p.protocol import incompatibility, layout_of
    from hwkv.interfaces import KVCache, KVCacheSpec, KVLayoutKind

    spec = KVCacheSpec(2, 4, 16, 2, 8, FP8_E4M3)
    a, b = (KVCache.allocate(spec, KVLayoutKind.PER_LAYER) for _ in range(2))
    bf = KVCache.allocate(replace(spec, dtype=torch.bfloat16), KVLayoutKind.PER_LAYER)
    assert a.format_key() == b.format_key() and ":" not in a.format_key() and "@" not in a.format_key()
    lay = lambda kv, eid: layout_of(kv, eid, "ep", "tcp")
    assert incompatibility(lay(a, "p"), lay(b, "d")) == ""
    b.set_scales(torch.full((2, 2, 2), 0.5))
    assert a.format_key() != b.format_key()
    assert "dtype differs: 'fp8_e4m3-vt-s" in incompatibility(lay(a, "p"), lay(b, "d"))
    assert "dtype differs" in incompatibility(lay(a, "p"), lay(bf, "d"))
    with pytest.raises(ValueError, match="only quantised caches"):
        bf.set_scales(torch.ones(2, 2, 2))


def test_checkpoint_kv_scales_are_used_for_fp8(tmp_path):
    """vLLM / llm-compressor checkpoints carry ``self_attn.k_scale`` / ``v_scale`` (per layer, or per KV
    head); an fp8 engine uses them unless ``kv_cache_scales`` is given, a model-dtype engine ignores them."""
    from safetensors.torch import load_file, save_file

    d = write_tiny_model(tmp_path / "m", max_position_embeddings=256)
    w = load_file(str(d / "model.safetensors"))
    w["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    w["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    w["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.125, 2.0])  # per KV head
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    e = hwkv.Engine(str(d), num_kv_blocks=32, kv_cache_dtype="fp8")
    want = torch.tensor([[[0.25, 0.25], [0.5, 0.5]], [[0.125, 2.0], [1.0, 1.0]]])
    assert torch.equal(e.kv_cache.scales, want)
    assert len(e.generate(_prompts(1), GREEDY, use_tqdm=False)[0].token_ids) == 12
    assert hwkv.Engine(str(d), num_kv_blocks=32).kv_cache.scales is None  # auto: the scales mean nothing
    e = hwkv.Engine(str(d), num_kv_blocks=32, kv_cache_dtype="fp8", kv_cache_scales=1.0)  # explicit wins
    assert bool((e.kv_cache.scales == 1).all())
    w["model.layers.0.self_attn.k_scale"] = torch.ones(3)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="KV scale 'model.layers.0.self_attn.k_scale' has 3 values"):
        hwkv.Engine(str(d), num_kv_blocks=32, kv_cache_dtype="fp8")


def test_offload_and_p2p_move_half_the_bytes_per_token(model_dir):
    """The offload connector (host tier) and the p2p connector (pull, tcp on loopback) move half the
    bytes per KV token for fp8 as for bf16 (p2p: plus the rest of the V page of each load's partial last
    block, at most 15 tokens' V at block size 16), measured by their counters through engines. Regression: the
    CPU device's block copy had no float8 index_copy_, so the fp8 host tier silently stored nothing."""
    from hwkv.bench.kv_dtype import moved_bytes

    got = {kd: moved_bytes(model_dir, "cpu", "bfloat16", kd, 512) for kd in ("auto", "fp8")}
    for conn in ("offload", "p2p"):
        if "skipped" in got["auto"][conn]:
            continue  # p2p needs Mooncake's transfer engine
        bf16, fp8 = got["auto"][conn], got["fp8"][conn]
        assert bf16["loaded_tokens"] == fp8["loaded_tokens"] > 0, (conn, got)
        if conn == "offload":  # whole blocks
            assert fp8["loaded_bytes"] * 2 == bf16["loaded_bytes"], (conn, got)
        else:  # K by tokens, fp8 V in whole [H_kv, D, block_size] pages: a load's partial last block costs its page
            v_token = bf16["loaded_bytes"] // bf16["loaded_tokens"] // 4  # fp8 V bytes of one token
            extra = fp8["loaded_bytes"] - bf16["loaded_bytes"] // 2
            assert 0 < extra <= fp8["loads"] * 15 * v_token and extra % v_token == 0, (conn, got)
    assert got["fp8"]["offload"]["stored_bytes"] * 2 == got["auto"]["offload"]["stored_bytes"]

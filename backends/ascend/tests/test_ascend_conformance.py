"""End to end on the emulator: the conformance suite's KV-write/attention tests and engine greedy
parity with the CPU reference. This proves the glue (metadata, layouts, op arguments), not the NPU
kernels — those only a run on Atlas hardware certifies (docs/ascend-backend.md)."""

from __future__ import annotations

import re

import pytest
import torch

import conformance
import hwkv
import hwkv.model.tiny as tiny


def test_conformance_attention_suite_passes_on_emulator(npu, tmp_path):
    # float16 over every head size / state / GQA ratio, bfloat16 on one head size: keeps CI fast;
    # `hwkv conformance --backend ascend --certify` on hardware runs everything.
    select = ("test_write_kv or (test_attention and not bfloat16 and not features) "
              "or (test_attention and bfloat16 and hd64 and not features) "
              "or (test_attention_features and float16 and not production)")
    report = conformance.run("ascend", report_dir=tmp_path, pytest_args=["-k", select])
    s = report["summary"]
    bad = [(t["id"], t["status"], t["reason"]) for t in report["tests"] if t["status"] not in ("PASS", "NOT_SUPPORTED")]
    assert bad == [] and s["FAIL"] == s["ERROR"] == s["TIMEOUT"] == 0
    passed = {t["capability"] for t in report["tests"] if t["status"] == "PASS"}
    assert {c for c in passed if c.startswith("attention/")} >= {
        "attention/prefill", "attention/prefix", "attention/decode", "attention/mixed"
    }, passed
    assert "attention_features/window" in passed, passed  # FIA's band mode against the reference
    assert s["PASS"] >= 80
    # Only what the backend declares out: float32 and block sizes other than 128.
    allowed = re.compile(r"dtype float32 not supported \(allowed: float16, bfloat16\)"
                         r"|block_size (?!128 )\d+ not supported \(allowed: exactly 128\)"
                         # A2 declares no graphs (slot -1 skipping is confirmed on A3 only): no padded rows
                         r"|padded rows not supported \(allowed: backends with graph capture,"
                         r" the only ones that pad a batch\)"
                         # no FIA / ATB input for them (hwkv_ascend.attention)
                         r"|attention feature (logit_softcap|attention_sinks) not supported"
                         r" \(supported: sliding_window\)"
                         r"|npu_fused_infer_attention_score and ATB PagedAttention have no logit soft-cap and no "
                         r"attention-sink input \(allowed: sliding_window, through FIA's band mode\)")
    parts = {p for t in report["tests"] if t["status"] == "NOT_SUPPORTED" for p in t["reason"].split("; ")}
    assert parts and all(allowed.fullmatch(p) for p in parts), parts
    assert "emulated" in report["device"]


def test_engine_greedy_parity_with_cpu_reference(npu, tmp_path, monkeypatch):
    from hwkv_ascend.attention import AscendMetadataBuilder

    seen = []
    real_build = AscendMetadataBuilder.build
    monkeypatch.setattr(AscendMetadataBuilder, "build", lambda self, c: seen.append(m := real_build(self, c)) or m)

    path = tiny.write_tiny_model(tmp_path / "m", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                                 num_layers=2, vocab_size=512)
    shared = list(range(20, 160))  # > one 128-token block: the second prompt hits the prefix cache
    prompts = [shared + [7, 8, 9], list(range(300, 350)), [5, 6], shared + [11, 12]]
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name in ("cpu", "ascend"):
        eng = hwkv.Engine(str(path), backend=name, dtype=torch.float16, block_size=128, num_kv_blocks=8,
                          max_num_batched_tokens=64, max_model_len=512)
        outs[name] = [list(r.token_ids) for r in eng.generate(prompts, params, use_tqdm=False)]
        if name == "ascend":
            assert eng.block_size == 128
            assert eng.kv_cache_manager.stats.hits >= 128  # the shared block was reused
    assert all(len(o) == 10 for o in outs["ascend"])
    assert outs["ascend"] == outs["cpu"]
    states = {m.state.value for m in seen}
    assert states == {"prefill_no_cache", "prefill_cache_hit", "chunked_prefill", "decode_only"}, states


def test_an_emulated_run_is_never_certified(npu, tmp_path):
    report = conformance.run("ascend", certify=True, report_dir=tmp_path)
    assert report["emulated"] is True and report["certified"] is False
    assert report["all_pass_or_not_supported"], [t for t in report["tests"] if t["status"] not in
                                                  ("PASS", "NOT_SUPPORTED")][:3]


def _windowed(tmp_path, arch: str, window: int):
    """A tiny model whose layers attend through ``window`` keys (qwen2: layer 0 full, layer 1 windowed,
    so two KV-cache groups; mistral: every layer windowed, one window group)."""
    import json

    path = tiny.write_tiny_model(tmp_path / arch, arch=arch, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64,
                                 num_layers=2, vocab_size=512, sliding_window=window)
    if arch == "qwen2":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "max_window_layers": 1}))
    return path


def test_windowed_engine_greedy_parity_with_cpu_reference(npu, tmp_path, monkeypatch):
    """Sliding windows through FIA's band mode in every state (prefill, prefix hit, chunks, decode) with
    KV-cache groups: the CPU reference's greedy tokens; window groups free blocks of 128 behind the window."""
    from hwkv_ascend.attention import AscendMetadataBuilder

    seen = []
    real_build = AscendMetadataBuilder.build
    monkeypatch.setattr(AscendMetadataBuilder, "build", lambda self, c: seen.append(m := real_build(self, c)) or m)
    shared = list(range(20, 160))
    prompts = [shared + list(range(200, 330)), list(range(300, 350)), shared + [11, 12], [5, 6]]
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for arch, windows in (("qwen2", [None, 40]), ("mistral", [40])):
        path = _windowed(tmp_path, arch, 40)
        outs = {}
        for name in ("cpu", "ascend"):
            eng = hwkv.Engine(str(path), backend=name, dtype=torch.float16, block_size=128, num_kv_blocks=12,
                              max_num_batched_tokens=64, max_model_len=512)
            assert [g.window for g in eng.config.kv_groups] == windows
            outs[name] = [list(r.token_ids) for r in eng.generate(prompts, params, use_tqdm=False)]
            assert all(m.block_pool.num_free_blocks == m.block_pool.num_usable_blocks
                       for m in eng.kv_cache_manager.managers)
        assert outs["ascend"] == outs["cpu"], arch
    assert {m.state.value for m in seen} >= {"prefill_no_cache", "chunked_prefill", "decode_only"}


@pytest.fixture(scope="module")
def capped_and_sunk(tmp_path_factory):
    """Gemma-2 (logit soft-cap) and GPT-OSS (sinks) checkpoints, written before the emulator is installed
    (transformers looks torch_npu up)."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("refused")
    kw = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              head_dim=64, vocab_size=256, max_position_embeddings=512, sliding_window=32)
    transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**kw, attn_logit_softcapping=5.0)).save_pretrained(
        out / "gemma2")
    transformers.GptOssForCausalLM(transformers.GptOssConfig(**kw, num_local_experts=2, num_experts_per_tok=1)
                                   ).save_pretrained(out / "oss")
    return out


def test_softcap_and_sinks_models_refused_by_name(capped_and_sunk, npu):
    for name, feature in (("gemma2", "logit_softcap"), ("oss", "attention_sinks")):
        with pytest.raises(ValueError, match=rf"attention feature {feature} not supported \(supported: "
                                             r"sliding_window\); npu_fused_infer_attention_score"):
            hwkv.Engine(str(capped_and_sunk / name), backend="ascend", dtype=torch.float16, block_size=128,
                        num_kv_blocks=8, max_model_len=256)

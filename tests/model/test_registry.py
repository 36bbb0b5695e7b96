"""Model registry: HF architectures → families; a family registered from outside serves its
checkpoints; the Qwen3 families refuse fused decode ops (the engine then runs their plain forward)
and validate their own config keys; Qwen3-MoE served by the engine matches transformers."""

from __future__ import annotations

import json

import pytest
import torch

from hwkv.model import LlamaForCausalLM, ModelConfig, ModelFamily, ModelLoadError, load_model, register
from hwkv.model import registry as reg
from hwkv.model.decode_ops import TorchDecodeOps
from hwkv.model.tiny import write_tiny_model

ALL = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
       "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@pytest.fixture
def isolated_registry(monkeypatch):
    reg.supported_architectures()  # built-ins loaded before the copy
    monkeypatch.setattr(reg, "_FAMILIES", dict(reg._FAMILIES))


def test_builtin_families():
    assert reg.supported_architectures() == ALL
    assert reg.family_of("MistralForCausalLM").model_class is LlamaForCausalLM
    assert reg.family_of("Qwen2ForCausalLM").name == "qwen2"
    assert reg.family_of("LlamaForCausalLM").fused_decode is None
    assert "q/k RMSNorm" in reg.family_of("Qwen3ForCausalLM").fused_decode
    with pytest.raises(KeyError):
        reg.family_of("GPT2LMHeadModel")


def test_unsupported_architecture_lists_every_family():
    with pytest.raises(ModelLoadError) as e:
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"]})
    assert "GPT2LMHeadModel" in str(e.value) and all(a in str(e.value) for a in ALL)


def test_a_registered_family_serves_its_architecture(tmp_path, cpu_backend, paged_runner, isolated_registry):
    seen = []

    def adapt(f, common):
        seen.append(f.integer("my_extra_key"))
        return {"extra": {"my_extra_key": seen[-1]}}

    register(ModelFamily("mine", ("MyLlamaForCausalLM",), LlamaForCausalLM, adapt))
    with pytest.raises(ValueError, match="'MyLlamaForCausalLM' is already served by model family 'mine'"):
        register(ModelFamily("other", ("MyLlamaForCausalLM",), LlamaForCausalLM))
    path = write_tiny_model(tmp_path / "m", tokenizer=False)
    llama = load_model(path, cpu_backend, load_tokenizer=False)[0]
    want = paged_runner(llama, cpu_backend, 1, 8).step([(0, [3, 4, 5], 0, 3)])
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MyLlamaForCausalLM"],
                                                  "my_extra_key": 7}))
    model, mc, _, _ = load_model(path, cpu_backend, load_tokenizer=False)
    assert mc.architecture == "MyLlamaForCausalLM" and mc.extra == {"my_extra_key": 7} and seen == [7]
    assert torch.equal(paged_runner(model, cpu_backend, 1, 8).step([(0, [3, 4, 5], 0, 3)]), want)
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MyLlamaForCausalLM"],
                                                  "my_extra_key": 0.5}))
    with pytest.raises(ModelLoadError, match=r"my_extra_key = 0\.5 is not allowed \(allowed: an integer >= 1\)"):
        load_model(path, cpu_backend, load_tokenizer=False)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fused_decode_ops_refused_and_engine_runs_plain(tmp_path, cpu_backend, monkeypatch, arch):
    from hwkv import Engine, SamplingParams

    path = write_tiny_model(tmp_path / arch, arch=arch, tokenizer=False)
    model = load_model(path, cpu_backend, load_tokenizer=False)[0]
    with pytest.raises(ValueError, match=r"TorchDecodeOps cannot serve Qwen3\w*ForCausalLM: per-head q/k RMSNorm"):
        model.set_decode_ops(TorchDecodeOps())
    assert model.decode_ops is None
    monkeypatch.setattr(type(cpu_backend), "decode_ops", lambda self: TorchDecodeOps())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = Engine(str(path), backend=cpu_backend, num_kv_blocks=32, decode_ops=False)
    eng = Engine(str(path), backend=cpu_backend, num_kv_blocks=32)  # None: only where the ops serve
    assert eng.model.decode_ops is None
    prompts = [[5, 6, 7, 8], [9, 10]]
    got = [o.token_ids for o in eng.generate(prompts, params, use_tqdm=False)]
    assert got == [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match="cannot serve Qwen3"):
        Engine(str(path), backend=cpu_backend, num_kv_blocks=32, decode_ops=True)


def test_engine_serves_qwen3_moe_like_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hwkv import Engine, SamplingParams

    path = write_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=3, num_experts=6, num_experts_per_tok=2,
                            moe_intermediate_size=32, tokenizer=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    # small blocks and a small token budget: chunked prefill and several requests per step
    eng = Engine(str(path), backend="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 23, 11)]
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               pad_token_id=2)[0, len(p):].tolist()
        assert list(o.token_ids) == want


@pytest.fixture(scope="module")
def moe_cfg(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", num_layers=4, tokenizer=False)
    return json.loads((path / "config.json").read_text())


def test_moe_layer_selection(moe_cfg):
    assert ModelConfig.from_dict(moe_cfg).extra["sparse_layers"] == (0, 1, 2, 3)
    assert ModelConfig.from_dict({**moe_cfg, "decoder_sparse_step": 2}).extra["sparse_layers"] == (1, 3)
    assert ModelConfig.from_dict({**moe_cfg, "mlp_only_layers": [0, 3]}).extra["sparse_layers"] == (1, 2)
    dense = ModelConfig.from_dict({**moe_cfg, "num_experts": 0})
    assert dense.extra["sparse_layers"] == () and dense.extra["num_experts_per_tok"] == 0
    renamed = {k: v for k, v in moe_cfg.items() if k != "num_experts"}  # transformers 5 writes this name
    assert ModelConfig.from_dict({**renamed, "num_local_experts": 4}).extra["num_experts"] == 4


@pytest.mark.parametrize(("change", "pattern"), [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok = 5 is not allowed \(allowed: an integer in \[1, 4\]\)"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok = 0 is not allowed"),
    ({"num_experts": -1}, r"num_experts = -1 is not allowed \(allowed: an integer >= 0\)"),
    ({"num_experts": None}, r"required key 'num_local_experts' is missing"),
    ({"moe_intermediate_size": None}, r"required key 'moe_intermediate_size' is missing"),
    ({"moe_intermediate_size": 16.5}, r"moe_intermediate_size = 16\.5"),
    ({"norm_topk_prob": 1}, r"norm_topk_prob = 1 is not allowed \(allowed: true or false\)"),
    ({"decoder_sparse_step": 0}, r"decoder_sparse_step = 0 is not allowed \(allowed: an integer >= 1\)"),
    ({"mlp_only_layers": [4]}, r"mlp_only_layers = 4 is not allowed \(allowed: an integer in \[0, 3\]\)"),
    ({"mlp_only_layers": 1}, r"mlp_only_layers = 1 is not allowed \(allowed: a list of layer indices"),
    ({"use_sliding_window": "no"}, r"use_sliding_window = 'no' is not allowed"),
])
def test_moe_config_validation(moe_cfg, change, pattern):
    with pytest.raises(ModelLoadError, match=pattern):
        ModelConfig.from_dict({**moe_cfg, **change})


def test_a_failed_builtin_import_is_not_remembered_as_loaded(monkeypatch):
    """A family module that fails to import raises on every lookup, not only the first (the next
    lookups would otherwise silently miss its architectures)."""
    from hwkv.model import registry

    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "BUILTIN_FAMILIES", (*registry.BUILTIN_FAMILIES, "hwkv.model.no_such_family"))
    for _ in range(2):
        with pytest.raises(ImportError, match="no_such_family"):
            registry.supported_architectures()

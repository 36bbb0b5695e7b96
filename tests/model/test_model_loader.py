"""Loader: config formats, sharded / tied checkpoints, and the errors for bad directories."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from hwkv.bench.common import decode_read_bytes
from hwkv.model import GenerationConfig, ModelConfig, ModelLoadError, load_model, resolve_dtype
from hwkv.model.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama")


def copy_model(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def logits_of(model, backend, runner, prompts):
    return runner(model, backend, len(prompts), 32).step([(i, p, 0, len(p)) for i, p in enumerate(prompts)])


PROMPTS = [[0, 5, 9, 100, 200], [0, 17], [3, 1, 4, 1, 5, 9, 2, 6, 5]]


def test_missing_directory_and_config(tmp_path, cpu_backend):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        load_model(tmp_path / "nope", cpu_backend)
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "config.json")) + ": file not found"):
        load_model(tmp_path, cpu_backend)


def test_malformed_config(tiny, tmp_path, cpu_backend):
    m = copy_model(tiny, tmp_path)
    (m / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(ModelLoadError, match=r"config\.json: malformed JSON"):
        load_model(m, cpu_backend)
    (m / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        load_model(m, cpu_backend)


def test_unsupported_architecture_lists_supported(tiny, tmp_path, cpu_backend):
    m = copy_model(tiny, tmp_path)
    edit_config(m, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as e:
        load_model(m, cpu_backend)
    msg = str(e.value)
    assert "config.json" in msg and "GPT2LMHeadModel" in msg
    assert all(a in msg for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))


def test_missing_required_key_and_bad_activation(tiny, tmp_path, cpu_backend):
    m = copy_model(tiny, tmp_path)
    edit_config(m, vocab_size=None)
    with pytest.raises(ModelLoadError, match="required key 'vocab_size' is missing"):
        load_model(m, cpu_backend)
    edit_config(m, vocab_size=512, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not supported"):
        load_model(m, cpu_backend)


@pytest.mark.parametrize("rope", [{"type": "dynamic", "factor": 2.0}, {"rope_type": "longrope", "factor": 2.0}])
def test_unsupported_rope_refused(tiny, tmp_path, cpu_backend, rope):
    m = copy_model(tiny, tmp_path)
    edit_config(m, rope_scaling=rope)
    with pytest.raises(ModelLoadError, match=r"rope type '\w+' is not supported \(supported: default, linear, llama3"):
        load_model(m, cpu_backend)


def test_missing_weights_file(tiny, tmp_path, cpu_backend):
    m = copy_model(tiny, tmp_path)
    (m / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: file not found"):
        load_model(m, cpu_backend)
    (m / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin: \.bin checkpoints are not supported"):
        load_model(m, cpu_backend)


def test_corrupt_weights_file(tiny, tmp_path, cpu_backend):
    m = copy_model(tiny, tmp_path)
    (m / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a valid safetensors file"):
        load_model(m, cpu_backend)


def test_missing_and_unexpected_tensors(tmp_path, cpu_backend):
    from safetensors.torch import load_file, save_file

    m = write_tiny_model(tmp_path / "m")
    w = load_file(m / "model.safetensors")
    lm = w.pop("lm_head.weight")
    save_file(w, m / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors: lm_head\.weight \(tie_word_embeddings is false"):
        load_model(m, cpu_backend)
    w["lm_head.weight"] = lm
    w["model.layers.0.self_attn.q_proj.qweight"] = torch.zeros(2)
    save_file(w, m / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.qweight'"):
        load_model(m, cpu_backend)
    del w["model.layers.0.self_attn.q_proj.qweight"]
    w["model.norm.weight"] = torch.ones(3)
    save_file(w, m / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.norm\.weight' has shape \(3,\), expected \(64,\)"):
        load_model(m, cpu_backend)


def test_sharded_equals_single(tmp_path, cpu_backend, paged_runner):
    single = write_tiny_model(tmp_path / "single", arch="qwen2", seed=3)
    sharded = write_tiny_model(tmp_path / "sharded", arch="qwen2", seed=3, num_shards=3)
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    a = logits_of(load_model(single, cpu_backend)[0], cpu_backend, paged_runner, PROMPTS)
    b = logits_of(load_model(sharded, cpu_backend)[0], cpu_backend, paged_runner, PROMPTS)
    assert torch.equal(a, b)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00003\.safetensors: shard listed in "
                                             r"model\.safetensors\.index\.json not found"):
        load_model(sharded, cpu_backend)
    (sharded / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(ModelLoadError, match="missing or empty 'weight_map'"):
        load_model(sharded, cpu_backend)


def test_tied_embeddings_share_storage_and_ignore_stored_head(tmp_path, cpu_backend, paged_runner):
    from safetensors.torch import load_file, save_file

    m = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    model, cfg, _, _ = load_model(m, cpu_backend)
    assert cfg.tie_word_embeddings and model.lm_head_weight is model.model.embed_tokens.weight
    assert not hasattr(model, "lm_head")
    assert model.param_bytes() == sum(t.numel() * 4 for t in load_file(m / "model.safetensors").values())
    assert decode_read_bytes(model) == model.param_bytes()
    before = logits_of(model, cpu_backend, paged_runner, PROMPTS)
    w = load_file(m / "model.safetensors")
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()  # some tied checkpoints store it
    save_file(w, m / "model.safetensors")
    assert torch.equal(before, logits_of(load_model(m, cpu_backend)[0], cpu_backend, paged_runner, PROMPTS))


def test_untied_param_and_decode_bytes(tiny, cpu_backend):
    model, cfg, _, _ = load_model(tiny, cpu_backend)
    emb = cfg.vocab_size * cfg.hidden_size * 4
    assert decode_read_bytes(model) == model.param_bytes() - emb
    spec = model.kv_cache_spec(num_blocks=10, block_size=16)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_size, spec.dtype) == (2, 2, 16, torch.float32)


def test_tokenizer_and_generation_config(tiny, tmp_path, cpu_backend):
    _, cfg, tok, gen = load_model(tiny, cpu_backend)
    assert gen.eos_token_ids == [1] and gen.bos_token_id == 0
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id == 0 and tok.decode(ids) == "Hello world"
    assert tok.eos_token_id == 1 and {0, 1, 2} <= tok.all_special_ids
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    m = copy_model(tiny, tmp_path)
    (m / "generation_config.json").write_text('{"eos_token_id": [1, 7]}')
    assert GenerationConfig.from_dir(m, cfg).eos_token_ids == [1, 7]
    (m / "generation_config.json").unlink()
    assert GenerationConfig.from_dir(m, cfg).eos_token_ids == [1]  # falls back to config.json
    (m / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: eos_token_id must be an int or a list"):
        GenerationConfig.from_dir(m, cfg)
    (m / "generation_config.json").unlink()
    (m / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: cannot be parsed by tokenizers"):
        load_model(m, cpu_backend)
    (m / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json: file not found"):
        load_model(m, cpu_backend)
    assert load_model(m, cpu_backend, load_tokenizer=False)[2] is None


def test_dtype_resolution(tiny):
    cfg = ModelConfig.from_dir(tiny)
    assert resolve_dtype(None, cfg) == torch.float32
    bf = ModelConfig.from_dict({**json.loads((tiny / "config.json").read_text()), "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", bf, (torch.float32, torch.bfloat16)) == torch.bfloat16
    assert resolve_dtype(None, bf, (torch.float32,)) == torch.float32
    assert resolve_dtype("fp16", cfg, (torch.float16,)) == torch.float16
    with pytest.raises(ValueError, match=r"dtype bfloat16 is not supported by the backend \(allowed: float32\)"):
        resolve_dtype(torch.bfloat16, cfg, (torch.float32,))
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported \(allowed: float32, bfloat16"):
        resolve_dtype("int8", cfg)


def test_config_details(tiny):
    base = json.loads((tiny / "config.json").read_text())
    q = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096,
                               "use_sliding_window": False, "dtype": "bfloat16"})
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None and q.dtype == torch.bfloat16
    mis = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 64})
    # windowed attention is computed, so the context is no longer capped at the window
    assert mis.sliding_window == 64 and mis.max_model_len == mis.max_position_embeddings
    assert mis.window_of(0) == 64 and mis.attention_features == ("sliding_window",)
    mis.check_max_model_len(65)
    qw = ModelConfig.from_dict({**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                                "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 2})
    assert [qw.window_of(i) for i in range(2)] == [None, 32]
    ll = ModelConfig.from_dict({**base, "sliding_window": 64})
    assert ll.sliding_window is None and ll.attention_features == ()
    llama = ModelConfig.from_dict({**base, "attention_bias": True, "head_dim": 32, "eos_token_id": [1, 2]})
    assert llama.qkv_bias and llama.o_bias and llama.head_dim == 32 and llama.eos_token_ids == [1, 2]
    l3 = ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0}})
    assert l3.rope_scaling["original_max_position_embeddings"] == base["max_position_embeddings"]
    with pytest.raises(ModelLoadError, match="rope type 'llama3' needs 'factor'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(ModelLoadError, match="not a multiple of num_key_value_heads 3"):
        ModelConfig.from_dict({**base, "num_key_value_heads": 3})

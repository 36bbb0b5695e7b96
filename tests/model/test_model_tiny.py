"""write_tiny_model: real HF format (transformers loads it), real tokenizer, deterministic weights."""

from __future__ import annotations

import hashlib

import pytest
import torch

from hwkv.model import load_model
from hwkv.model.tiny import ARCHS, QWEN, build_tokenizer, write_tiny_model

TEXT = "Hello, world! The quick brown fox — ünïcode 你好 and numbers 12345."


GREEDY = {  # arch, tied, head_dim (qwen3: 4 heads x 32 wide q on a 64-wide residual stream)
    "llama": ("llama", False, 32), "qwen2": ("qwen2", False, None), "mistral": ("mistral", True, None),
    "qwen3": ("qwen3", False, 32), "qwen3-tied": ("qwen3", True, None), "qwen3_moe": ("qwen3_moe", False, 32),
}


@pytest.mark.parametrize("case", list(GREEDY))
def test_transformers_loads_it_and_greedy_matches(tmp_path, cpu_backend, paged_runner, case):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    arch, tied, head_dim = GREEDY[case]
    path = write_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=tied, head_dim=head_dim)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(hf).__name__ == ARCHS[arch]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == hf.config.vocab_size == 512
    ids = tok.encode(TEXT).ids
    assert tok.decode(ids) == TEXT
    assert (ids[0] == 0) == (arch not in QWEN)  # Llama/Mistral prepend BOS, Qwen does not

    model, cfg, our_tok, gen = load_model(path, cpu_backend)
    assert our_tok.encode(TEXT) == ids and gen.eos_token_ids == [1]
    n_new = 12
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=n_new, do_sample=False, min_new_tokens=n_new,
                           pad_token_id=2)[0, len(ids):].tolist()
    r = paged_runner(model, cpu_backend, 1, len(ids) + n_new)
    seq = list(ids)
    got = []
    for _ in range(n_new):
        logits = r.step([(0, seq, 0 if not got else len(seq) - 1, len(seq))]).clone()
        logits[0, gen.eos_token_ids] = -float("inf")  # as min_new_tokens does
        got.append(int(logits[0].argmax()))
        seq.append(got[-1])
    assert got == want
    if not tied:  # (a tied head tends to echo its input)
        assert len(set(got)) > 3  # random weights still give varied, non-degenerate text


def test_deterministic_in_seed(tmp_path):
    digest = lambda p: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()
    a = write_tiny_model(tmp_path / "a", seed=7)
    b = write_tiny_model(tmp_path / "b", seed=7)
    c = write_tiny_model(tmp_path / "c", seed=8)
    assert digest(a) == digest(b) != digest(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_tokenizer_covers_every_model_id():
    tok = build_tokenizer(1000, add_bos=False)
    assert tok.get_vocab_size() == 1000
    assert all(tok.id_to_token(i) is not None for i in range(1000))
    assert tok.decode(tok.encode(TEXT).ids) == TEXT


def test_bf16_checkpoint(tmp_path, cpu_backend):
    path = write_tiny_model(tmp_path / "bf", dtype=torch.bfloat16, arch="mistral")
    model, cfg, _, _ = load_model(path, cpu_backend)
    assert cfg.dtype == torch.bfloat16 and model.dtype == torch.bfloat16  # "auto" takes the checkpoint's
    assert load_model(path, cpu_backend, dtype="float32")[0].dtype == torch.float32


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"arch 'gpt2' is not supported \(allowed: llama, qwen2, mistral, qwen3, "
                                         r"qwen3_moe\)"):
        write_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="vocab_size must be >= 320"):
        write_tiny_model(tmp_path, vocab_size=100)


def test_forward_hidden_without_a_slot_mapping_says_what_it_needs(tmp_path, cpu_backend):
    model = load_model(write_tiny_model(tmp_path / "m"), cpu_backend)[0]
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(TypeError, match=r"forward_hidden needs slot_mapping: object does not carry one"):
        model.forward_hidden(ids, torch.arange(3), kv_cache=None, attn_metadata=object())

"""Write tiny random-weight Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE checkpoints in the real HF format.

Needs only torch, safetensors and tokenizers (no transformers): the README demo builds its model
with this. The tokenizer is a byte-level BPE trained on a small built-in English text, so any text
round-trips. Weights are deterministic in ``seed``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
QWEN = ("qwen2", "qwen3", "qwen3_moe")  # no BOS, rope_theta 1e6, windows only with use_sliding_window
MIN_VOCAB = 320  # 256 byte symbols + specials + some merges

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small model can still say a few words.
Once upon a time there was a little engine that served tokens to many people at the same time.
It kept a cache of keys and values in blocks, and when two people asked the same question, it
remembered the answer to the first part and only computed the rest.
The scheduler looked at the running requests first, then at the waiting ones, and never spent
more tokens in one step than its budget allowed. When memory ran out, the newest request waited.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris.
What is two plus two? Four. The sun rises in the east and sets in the west.
Water is made of hydrogen and oxygen. Trees grow from seeds, and rivers flow to the sea.
In the morning we drink coffee or tea; in the evening we read a book and go to sleep.
Numbers: one two three four five six seven eight nine ten, 0 1 2 3 4 5 6 7 8 9 10 100 1000.
The weather is nice, the sky is blue, and the birds are singing in the garden near the house.
Machine learning models turn text into tokens, tokens into vectors, and vectors back into text.
A language model predicts the next token given the previous ones, one step after another.
"""


def build_tokenizer(vocab_size: int, add_bos: bool) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids; ids 0/1/2 are
    BOS/EOS/PAD. Training is deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} for the byte-level tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    # The corpus may yield fewer merges than asked: pad with plain added words so every model id decodes.
    n = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(f" word{i}", normalized=False) for i in range(vocab_size - n)])
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def _config(arch: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int | None, inter: int,
            vocab: int, dtype: torch.dtype, tie: bool, rope_scaling: dict | None, max_pos: int,
            sliding_window: int | None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if arch in QWEN else 10000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "vocab_size": vocab,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "initializer_range": 0.02,
        "use_cache": True,
        "attention_dropout": 0.0,
        "bos_token_id": None if arch in QWEN else 0,
        "eos_token_id": 1,
    }
    if head_dim is not None or arch.startswith("qwen3"):  # (transformers' Qwen3 default head_dim is 128)
        cfg["head_dim"] = head_dim or hidden // heads
    if arch.startswith("qwen3"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        cfg["sliding_window"] = sliding_window
    else:
        cfg.update(sliding_window=sliding_window, use_sliding_window=sliding_window is not None)
        cfg["max_window_layers"] = layers
    return cfg


def _moe_config(cfg: dict[str, Any], num_experts: int, top_k: int, inter: int | None) -> None:
    cfg.update(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter or cfg["hidden_size"],
               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)


def _mlp_weights(w: dict[str, torch.Tensor], prefix: str, h: int, inter: int, rnd: Any) -> None:
    for name, n_out, n_in in (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)):
        w[prefix + f"{name}.weight"] = rnd(n_out, n_in)


def _weights(cfg: dict[str, Any], seed: int, dtype: torch.dtype, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator(device).manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rnd(*shape: int, std: float | None = None, mean: float = 0.0) -> torch.Tensor:
        # Scaled so activations stay O(1) at any width and greedy text is varied, not a 2-token loop.
        std = 0.8 / shape[-1] ** 0.5 if std is None else std
        return (torch.randn(*shape, generator=g, device=device) * std + mean).to(dtype).cpu()

    # A tied head reads the residual stream, which a large embedding would dominate (echoing the input).
    w = {"model.embed_tokens.weight": rnd(vocab, h, std=0.4 / h**0.5 if cfg["tie_word_embeddings"] else 0.5)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = rnd(h, std=0.05, mean=1.0)
        w[p + "post_attention_layernorm.weight"] = rnd(h, std=0.05, mean=1.0)
        for name, n_out, n_in in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            w[p + f"self_attn.{name}.weight"] = rnd(n_out, n_in)
            if cfg["model_type"] == "qwen2" and name != "o_proj":
                w[p + f"self_attn.{name}.bias"] = rnd(n_out, std=0.02)
        if cfg["model_type"].startswith("qwen3"):
            w[p + "self_attn.q_norm.weight"] = rnd(d, std=0.05, mean=1.0)
            w[p + "self_attn.k_norm.weight"] = rnd(d, std=0.05, mean=1.0)
        if cfg.get("num_experts"):
            w[p + "mlp.gate.weight"] = rnd(cfg["num_experts"], h, std=2 / h**0.5)  # decisive routing
            for e in range(cfg["num_experts"]):
                _mlp_weights(w, p + f"mlp.experts.{e}.", h, cfg["moe_intermediate_size"], rnd)
        else:
            _mlp_weights(w, p + "mlp.", h, inter, rnd)
    w["model.norm.weight"] = rnd(h, std=0.05, mean=1.0)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(vocab, h, std=4 / h**0.5)
    return w


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    sliding_window: int | None = None,
    num_shards: int = 1,
    rope_theta: float | None = None,
    tokenizer: bool = True,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    device: str = "cpu",
) -> Path:
    """Write config.json, model.safetensors (or ``num_shards`` shards + index json),
    generation_config.json, tokenizer.json and tokenizer_config.json to ``path``; return it.
    ``rope_theta`` overrides the arch default; ``tokenizer=False`` skips the tokenizer files (a
    benchmark fed token ids needs none, and a 128k-entry vocabulary is slow to build). ``qwen3_moe``:
    every layer routes over ``num_experts`` experts of width ``moe_intermediate_size`` (default
    ``hidden_size``), top ``num_experts_per_tok``, renormalised. ``device``: where the random weights are
    drawn (a GPU: seconds for an 8B shape instead of minutes; other values than the CPU's)."""
    from safetensors.torch import save_file

    if arch not in ARCHS:
        raise ValueError(f"arch {arch!r} is not supported (allowed: {', '.join(ARCHS)})")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    inter = intermediate_size or 2 * hidden_size
    cfg = _config(arch, hidden_size, num_layers, num_heads, num_kv_heads, head_dim, inter, vocab_size, dtype,
                  tie_word_embeddings, rope_scaling, max_position_embeddings, sliding_window)
    if rope_theta is not None:
        cfg["rope_theta"] = float(rope_theta)
    if arch == "qwen3_moe":
        _moe_config(cfg, num_experts, num_experts_per_tok, moe_intermediate_size)
    weights = _weights(cfg, seed, dtype, device)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer:
        _write_tokenizer(path, arch, vocab_size, max_position_embeddings)
    meta = {"format": "pt"}
    if num_shards == 1:
        save_file(weights, str(path / "model.safetensors"), metadata=meta)
        return path
    names = list(weights)
    weight_map: dict[str, str] = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s::num_shards]}
        save_file(part, str(path / fname), metadata=meta)
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


def _write_tokenizer(path: Path, arch: str, vocab_size: int, max_position_embeddings: int) -> None:
    tok = build_tokenizer(vocab_size, add_bos=arch not in QWEN)
    tok.save(str(path / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None if arch in QWEN else BOS,
        "eos_token": EOS, "pad_token": PAD, "model_max_length": max_position_embeddings,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")

"""Convert a tiny HF checkpoint (``write_tiny_model``) to GGUF the way llama.cpp's converter does:
``gguf.GGUFWriter`` metadata, the tokenizer's vocabulary and merges, Llama's q/k rows permuted, 2-D
weights quantised with ``gguf.quants`` (norms and biases stay F32). Needs the ``gguf`` package."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hwkv.model.gguf_file import GLOBAL_NAMES, LAYER_NAMES

# the loader's tables inverted: what the loader reads is by construction what this writes
_HF_TO_GGUF = {hf: g for g, hf in LAYER_NAMES.items()}
_GLOBAL = {hf: g for g, hf in GLOBAL_NAMES.items()}


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}"


def quantized(w: torch.Tensor, qtype: str) -> tuple[np.ndarray, Any]:
    """``(bytes or array, raw_dtype)`` of ``w`` in ``qtype`` for ``GGUFWriter.add_tensor``."""
    import gguf
    from gguf import quants

    a = w.float().numpy()
    if qtype == "F32":
        return a, None
    if qtype == "F16":
        return a.astype(np.float16), None
    t = gguf.GGMLQuantizationType[qtype]
    return quants.quantize(a, t), t


def dequantized(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """What a loader must produce from ``w`` written as ``qtype`` (float32)."""
    import gguf
    from gguf import quants

    data, raw = quantized(w, qtype)
    if raw is None:
        return torch.from_numpy(data.astype(np.float32))
    return torch.from_numpy(quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).reshape(w.shape))


def write_tiny_gguf(hf_dir: str | Path, out: str | Path, qtype: str = "F32", meta: dict[str, Any] | None = None,
                    drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                    arch: str | None = None) -> Path:
    """Write ``out`` (a ``.gguf``) from the HF checkpoint ``hf_dir``. ``meta``: metadata to add or
    override (``None`` drops a key); ``drop``: GGUF tensor names to leave out; ``extra``: tensors to
    add as given; ``arch``: the GGUF architecture (default from config.json's model_type)."""
    import gguf
    from safetensors.torch import load_file

    from hwkv.model.gguf_file import permute

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or cfg["model_type"]
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == cfg["vocab_size"] and all(vocab[t] == i for i, t in enumerate(tokens))
    added = {a["content"]: a["special"] for a in tok["added_tokens"]}
    types = [3 if added.get(t) else 4 if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    values: dict[str, Any] = {
        "general.architecture": arch, "general.name": hf_dir.name,
        f"{arch}.context_length": cfg["max_position_embeddings"], f"{arch}.embedding_length": cfg["hidden_size"],
        f"{arch}.block_count": cfg["num_hidden_layers"], f"{arch}.feed_forward_length": cfg["intermediate_size"],
        f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.dimension_count": head_dim, f"{arch}.rope.freq_base": float(cfg.get("rope_theta", 10000.0)),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), f"{arch}.vocab_size": len(tokens),
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.eos_token_id": vocab[tok_cfg["eos_token"]],
        "tokenizer.ggml.padding_token_id": vocab[tok_cfg["pad_token"]],
        "tokenizer.ggml.add_bos_token": tok_cfg.get("bos_token") is not None,
        "tokenizer.chat_template": tok_cfg["chat_template"],
    }
    if tok_cfg.get("bos_token"):
        values["tokenizer.ggml.bos_token_id"] = vocab[tok_cfg["bos_token"]]
    for k, v in (meta or {}).items():
        if v is None:
            values.pop(k, None)
        else:
            values[k] = v
    w = gguf.GGUFWriter(str(out), values.get("general.architecture", arch))
    w.kv_data[0].pop("general.architecture", None)  # written below like every other key
    for k, v in values.items():
        _add(w, k, v)
    weights = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    for name, t in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute(t, heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute(t, kv_heads)
        g = gguf_name(name)
        if g in drop:
            continue
        data, raw = quantized(t, qtype if t.dim() == 2 else "F32")
        w.add_tensor(g, data, raw_dtype=raw)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add(w: Any, key: str, v: Any) -> None:
    import gguf

    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v) if v >= 0 else w.add_int32(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, list):
        w.add_array(key, v)
    else:
        w.add_key_value(key, v, gguf.GGUFValueType.get_type(v))

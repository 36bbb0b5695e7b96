"""Random-weight EAGLE-1 heads with the published tensor names, for tests and benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_eagle_head(path: str | Path, hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int | None = None, vocab_size: int = 512, seed: int = 0,
                     fc_bias: bool = False, with_embed: bool = False, dtype: torch.dtype = torch.float32,
                     rope_theta: float = 10000.0, max_position_embeddings: int = 512) -> str:
    """An EAGLE-1 head for a Llama target of ``hidden_size`` (SafeAILab / vLLM ``EagleLlamaForCausalLM``
    names): ``fc [H, 2H]``, one layer without ``input_layernorm``, no ``lm_head`` (the target's), an
    own ``embed_tokens`` only with ``with_embed``. Returns the directory."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    h, hd = hidden_size, hidden_size // num_heads
    inter = intermediate_size or 2 * hidden_size
    cfg = {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": num_heads,
           "num_key_value_heads": num_kv_heads, "vocab_size": vocab_size, "rms_norm_eps": 1e-6,
           "max_position_embeddings": max_position_embeddings, "rope_theta": rope_theta,
           "torch_dtype": str(dtype).removeprefix("torch."), "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu"}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(dtype)  # noqa: E731
    w = {"fc.weight": r(h, 2 * h), "layers.0.self_attn.q_proj.weight": r(num_heads * hd, h),
         "layers.0.self_attn.k_proj.weight": r(num_kv_heads * hd, h),
         "layers.0.self_attn.v_proj.weight": r(num_kv_heads * hd, h),
         "layers.0.self_attn.o_proj.weight": r(h, num_heads * hd), "layers.0.mlp.gate_proj.weight": r(inter, h),
         "layers.0.mlp.up_proj.weight": r(inter, h), "layers.0.mlp.down_proj.weight": r(h, inter),
         "layers.0.post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    if fc_bias:
        w["fc.bias"] = r(h)
    if with_embed:
        w["embed_tokens.weight"] = r(vocab_size, h)
    save_file(w, str(path / "model.safetensors"))
    return str(path)

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from hwkv.model.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("spec") / "target", vocab_size=512,
                                max_position_embeddings=512))


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> str:
    """A 1-layer model of the target's vocabulary (different weights: low acceptance)."""
    from hwkv.model.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("spec") / "draft", vocab_size=512, num_layers=1, seed=1,
                                max_position_embeddings=512, tokenizer=False))


def write_tiny_eagle(path, hidden_size: int = 64, vocab_size: int = 512, seed: int = 0, fc_bias: bool = False,
                     with_embed: bool = False, heads: int = 4, kv_heads: int = 2):
    """A random-weight EAGLE-1 head with the published tensor names (no input_layernorm on its one
    layer, no lm_head: the target's) for a Llama target of ``hidden_size``."""
    from hwkv.spec_decode.tiny_heads import write_eagle_head

    return write_eagle_head(path, hidden_size, heads, kv_heads, vocab_size=vocab_size, seed=seed, fc_bias=fc_bias,
                            with_embed=with_embed)


@pytest.fixture(scope="session")
def tiny_eagle(tmp_path_factory) -> str:
    return write_tiny_eagle(tmp_path_factory.mktemp("spec") / "eagle")


def write_tiny_eagle3(path, hidden_size: int = 64, draft_vocab: int = 128, seed: int = 0, heads: int = 4,
                      kv_heads: int = 2, aux=(0, 1, 1)):
    """A random-weight EAGLE-3 head with the published names (``midlayer.*``, ``fc [H, 3H]``,
    ``hidden_norm``, ``norm``, a draft-vocabulary ``lm_head`` and ``d2t``: draft id i -> target 3 i)."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    h, inter, hd = hidden_size, 2 * hidden_size, hidden_size // heads
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": 512, "draft_vocab_size": draft_vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "rope_theta": 10000.0, "torch_dtype": "float32",
           "eagle_aux_hidden_state_layer_ids": list(aux)}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    m = "midlayer."
    w = {"fc.weight": r(h, len(aux) * h), m + "self_attn.q_proj.weight": r(heads * hd, 2 * h),
         m + "self_attn.k_proj.weight": r(kv_heads * hd, 2 * h), m + "self_attn.v_proj.weight": r(kv_heads * hd, 2 * h),
         m + "self_attn.o_proj.weight": r(h, heads * hd), m + "mlp.gate_proj.weight": r(inter, h),
         m + "mlp.up_proj.weight": r(inter, h), m + "mlp.down_proj.weight": r(h, inter),
         m + "input_layernorm.weight": torch.ones(h), m + "hidden_norm.weight": torch.ones(h),
         m + "post_attention_layernorm.weight": torch.ones(h), "norm.weight": torch.ones(h),
         "lm_head.weight": r(draft_vocab, h), "d2t": 2 * torch.arange(draft_vocab),
         "t2d": torch.zeros(512, dtype=torch.bool)}
    save_file(w, str(path / "model.safetensors"))
    return str(path)

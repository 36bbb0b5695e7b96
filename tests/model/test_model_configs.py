"""config.json files as real checkpoints ship them parse, and their RoPE frequencies equal
transformers' own (no weights needed)."""

from __future__ import annotations

import pytest
import torch

from hwkv.model.config import ModelConfig
from hwkv.model.rope import inv_freq_and_scale

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.42.3",
    "use_cache": True, "vocab_size": 128256,
}
LLAMA32_1B = {
    **LLAMA31_8B, "head_dim": 64, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "tie_word_embeddings": True, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "tie_word_embeddings": False,
    "torch_dtype": "float16", "use_cache": True, "vocab_size": 32000,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}
QWEN25_YARN = {**QWEN25_7B, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_06B = {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
             "num_hidden_layers": 28, "max_window_layers": 28, "tie_word_embeddings": True}
QWEN3_30B_A3B = {
    **QWEN3_8B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
    "hidden_size": 2048, "intermediate_size": 6144, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "router_aux_loss_coef": 0.001, "rope_theta": 1000000.0,
}
REAL = {"qwen3-8b": QWEN3_8B, "qwen3-0.6b": QWEN3_06B, "qwen3-30b-a3b": QWEN3_30B_A3B,
        "llama3.1-8b": LLAMA31_8B, "llama3.2-1b": LLAMA32_1B, "llama2-7b": LLAMA2_7B, "qwen2.5-7b": QWEN25_7B,
        "qwen2.5-yarn": QWEN25_YARN, "mistral-7b-v0.1": MISTRAL_7B_V01}


def test_fields_of_real_configs():
    l31 = ModelConfig.from_dict(LLAMA31_8B)
    assert (l31.head_dim, l31.num_kv_heads, l31.rope_theta, l31.dtype) == (128, 8, 500000.0, torch.bfloat16)
    assert l31.eos_token_ids == [128001, 128008, 128009] and not l31.qkv_bias and l31.max_model_len == 131072
    assert l31.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    l32 = ModelConfig.from_dict(LLAMA32_1B)
    assert l32.tie_word_embeddings and l32.head_dim == 64 and l32.rope_scaling["factor"] == 32.0
    l2 = ModelConfig.from_dict(LLAMA2_7B)
    assert l2.rope_scaling is None and l2.num_kv_heads == 32 and l2.dtype == torch.float16
    q = ModelConfig.from_dict(QWEN25_7B)
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None and q.max_model_len == 32768
    m = ModelConfig.from_dict(MISTRAL_7B_V01)
    assert m.sliding_window == 4096 and m.max_model_len == 32768  # windowed attention: the whole context
    assert m.window_of(0) == 4096 and m.attention_features == ("sliding_window",)
    q3 = ModelConfig.from_dict(QWEN3_8B)  # head_dim 128 with 32 heads on a 4096 stream; 0.6B: 16 x 128 on 1024
    assert (q3.head_dim, q3.num_heads, q3.hidden_size, q3.qkv_bias, q3.o_bias) == (128, 32, 4096, False, False)
    q06 = ModelConfig.from_dict(QWEN3_06B)
    assert q06.head_dim * q06.num_heads == 2 * q06.hidden_size and q06.tie_word_embeddings
    assert q06.sliding_window is None and q06.rope_theta == 1e6 and q06.eos_token_ids == [151645]
    moe = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert moe.extra == {"num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                         "moe_intermediate_size": 768, "sparse_layers": tuple(range(48))}


GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "bos_token_id": 2, "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32", "vocab_size": 256000,
}
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
    "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}


def test_fields_of_real_gemma_configs():
    g2 = ModelConfig.from_dict(GEMMA2_2B)  # hidden_act gelu_pytorch_tanh is Gemma's, refused for Llama
    assert [g2.window_of(i) for i in range(4)] == [4096, None, 4096, None] and g2.max_model_len == 8192
    assert g2.extra == {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    assert g2.tie_word_embeddings and g2.head_dim == 256
    g3 = ModelConfig.from_dict(GEMMA3_1B)  # the transformers-4 form: rope_local_base_freq, sliding_window_pattern
    assert [i for i in range(26) if g3.window_of(i) is None] == [5, 11, 17, 23]
    assert g3.rope_theta == 1e6 and g3.extra["rope_local_theta"] == 10000 and g3.eos_token_ids == [1, 106]
    assert g3.attention_features == ("sliding_window",) and g3.max_model_len == 32768
    with pytest.raises(Exception, match="hidden_act 'gelu_pytorch_tanh' is not supported \\(allowed: silu\\)"):
        ModelConfig.from_dict({**LLAMA2_7B, "hidden_act": "gelu_pytorch_tanh"})


@pytest.mark.parametrize("name", list(REAL))
def test_rope_frequencies_equal_transformers(name):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = REAL[name]
    hf_cfg = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                                       if k != "model_type"})
    ours = ModelConfig.from_dict(raw)
    inv, scale = inv_freq_and_scale(ours)
    kind = hf_cfg.rope_parameters["rope_type"]
    if kind == "default":
        want = 1.0 / (ours.rope_theta ** (torch.arange(0, ours.head_dim, 2, dtype=torch.float) / ours.head_dim))
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    assert torch.equal(inv, want) and scale == pytest.approx(want_scale, rel=1e-12)

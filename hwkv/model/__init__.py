"""Model families (Llama/Mistral/Qwen2, Qwen3, Qwen3-MoE): HF-directory loader, a registry from HF
``architectures`` to the family serving it, forward over the backend's attention, sampler."""

from hwkv.model.config import ModelConfig, ModelLoadError, parse_dtype
from hwkv.model.llama import LlamaForCausalLM
from hwkv.model.loader import GenerationConfig, load_model, load_weights, resolve_dtype, weight_files
from hwkv.model.registry import ModelFamily, family_of, register, supported_architectures
from hwkv.model.sampler import SamplerOutput, SamplingBatch, make_generator, sample
from hwkv.model.tokenizer import Tokenizer

__all__ = [
    "GenerationConfig", "LlamaForCausalLM", "ModelConfig", "ModelFamily", "ModelLoadError", "SamplerOutput",
    "SamplingBatch", "Tokenizer", "family_of", "load_model", "load_weights", "make_generator", "parse_dtype",
    "register", "resolve_dtype", "sample", "supported_architectures", "weight_files",
]

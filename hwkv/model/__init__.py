"""Llama-family model: HF-directory loader, forward over the backend's attention, sampler."""

from hwkv.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError, parse_dtype
from hwkv.model.llama import LlamaForCausalLM
from hwkv.model.loader import GenerationConfig, load_model, load_weights, resolve_dtype, weight_files
from hwkv.model.sampler import SamplerOutput, SamplingBatch, make_generator, sample
from hwkv.model.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES", "GenerationConfig", "LlamaForCausalLM", "ModelConfig", "ModelLoadError",
    "SamplerOutput", "SamplingBatch", "Tokenizer", "load_model", "load_weights", "make_generator",
    "parse_dtype", "resolve_dtype", "sample", "weight_files",
]

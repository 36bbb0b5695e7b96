"""The user-facing engine: ``hwkv.Engine(model, backend=...).generate(prompts, SamplingParams(...))``."""

from hwkv.engine.config import EngineArgs, EngineConfig
from hwkv.engine.engine import Engine

__all__ = ["Engine", "EngineArgs", "EngineConfig"]

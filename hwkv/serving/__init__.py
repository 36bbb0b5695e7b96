"""Serving: an engine-core process (scheduler + model runner) behind ZMQ, the asyncio front end
(:class:`AsyncEngine`) and the OpenAI-compatible HTTP server (``hwkv serve``)."""

from hwkv.serving.async_engine import AsyncEngine
from hwkv.serving.client import EngineDeadError

__all__ = ["AsyncEngine", "EngineDeadError"]

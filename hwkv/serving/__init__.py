"""Serving: an engine-core process (scheduler + model runner) behind ZMQ, the asyncio front end
(:class:`AsyncEngine`), :class:`MultiprocessEngine` (Engine's synchronous API over the core) and
the OpenAI-compatible HTTP server (``hwkv serve``)."""

from hwkv.serving.async_engine import AsyncEngine
from hwkv.serving.client import EngineDeadError
from hwkv.serving.sync_engine import MultiprocessEngine

__all__ = ["AsyncEngine", "EngineDeadError", "MultiprocessEngine"]

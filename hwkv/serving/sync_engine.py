"""MultiprocessEngine: :class:`hwkv.Engine`'s synchronous API over an engine-core process.

::

    with MultiprocessEngine("path/to/hf-dir", backend="cuda") as engine:
        outs = engine.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

The scheduler and model runner run in the core process (as under ``hwkv serve``), the text work
in this one, so detokenizing and building outputs overlap the model's steps. It drives an
:class:`AsyncEngine` on an event loop in a background thread. ``add_request``/``step``/``abort``
behave as the in-process Engine's (``step`` returns the newest cumulative output of each request
that advanced since the last call, waiting for one while any request is unfinished); the
in-process ``hwkv.Engine`` stays the tool for debugging and tests.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine
from typing import Any

from hwkv.outputs import RequestOutput
from hwkv.serving.async_engine import AsyncEngine, Prompt


class MultiprocessEngine:
    def __init__(self, model: str, *, startup_timeout: float = 600.0, **engine_kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hwkv-mp-engine", daemon=True)
        self._thread.start()
        self._outputs: queue.Queue[tuple[str, RequestOutput | BaseException]] = queue.Queue()
        self._live: set[str] = set()  # requests added with add_request and not yet finished
        try:
            self.engine = self._call(self._make(model, startup_timeout, engine_kwargs))
        except BaseException:
            self._stop_loop()
            raise

    async def _make(self, model: str, timeout: float, kw: dict[str, Any]) -> AsyncEngine:
        return await AsyncEngine(model, startup_timeout=timeout, **kw).start()

    def _call(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ---- Engine's API -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: Any = None, priority: int = 0) -> None:
        """Validate (``ValueError``) and queue a request; its outputs come from ``step()``."""
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in use (request ids must be unique)")
        self._call(self._add(request_id, prompt, params, priority))
        self._live.add(request_id)

    async def _add(self, request_id: str, prompt: Prompt, params: Any, priority: int) -> None:
        it = self.engine.generate(prompt, params, request_id, priority)  # raises ValueError here

        async def pump() -> None:
            try:
                async for out in it:
                    self._outputs.put((request_id, out))
            except BaseException as e:  # EngineDeadError, or cancelled by shutdown
                self._outputs.put((request_id, e))

        asyncio.ensure_future(pump())

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Outputs of the requests that advanced since the last call (the newest of each); waits
        up to ``timeout`` for the first while a request is unfinished. ``EngineDeadError`` if the
        core is gone."""
        got: dict[str, RequestOutput] = {}
        block = bool(self._live)
        while True:
            try:
                rid, item = self._outputs.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return list(got.values())
            block = False
            if isinstance(item, BaseException):
                self._live.discard(rid)
                raise item
            got[rid] = item
            if item.finished:
                self._live.discard(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output (finish_reason "abort") comes from the next ``step()``."""
        self._call(self.engine.abort(request_id))

    def has_unfinished(self) -> bool:
        return bool(self._live) or not self._outputs.empty()

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: Any = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. Every prompt is validated first."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(
            prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        return self._call(self._generate(prompts, params))

    async def _generate(self, prompts: list[Prompt], params: list[Any]) -> list[RequestOutput]:
        its = [self.engine.generate(p, sp) for p, sp in zip(prompts, params)]  # all validated before any runs

        async def last(it: Any) -> RequestOutput:
            out = None
            async for out in it:  # noqa: B007 - the last output is the result
                pass
            return out

        return list(await asyncio.gather(*(last(it) for it in its)))

    def stats(self) -> dict[str, Any]:
        """The core's ``Engine.stats()``."""
        return self._call(self.engine.stats())

    # ---- life cycle ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the core process and the loop thread (idempotent)."""
        if self._thread.is_alive():
            try:
                self._call(self.engine.shutdown(), timeout=30)
                self._call(_cancel_others(), timeout=10)
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> MultiprocessEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


async def _cancel_others() -> None:
    """End the loop's other tasks (request pumps, the output reader) before it stops."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

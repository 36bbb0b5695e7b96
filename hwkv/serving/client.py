"""CoreClient: starts the engine-core process and talks to it over ZMQ (asyncio side).

The client binds two IPC sockets in a private temporary directory (input: PUSH → core PULL,
output: core PUSH → client PULL) and launches ``python -m hwkv.serving.core`` with the config as
JSON. A thread waits on the process, so a core that dies — crash, OOM kill, SIGKILL — is noticed
at once, not on the next timeout; ``on_death`` is then called on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from hwkv.serving import messages as m


class EngineDeadError(RuntimeError):
    """The engine-core process is gone (or failed): no request can make progress."""


class CoreClient:
    def __init__(self, model: str, engine_kwargs: dict[str, Any], kv_connector: str | None = None,
                 kv_connector_config: dict[str, Any] | None = None):
        self._dir = tempfile.mkdtemp(prefix="hwkv-core-")
        # Input is a plain socket sent to without blocking (an unbounded queue): a send never
        # waits on the core, and one with no core connected fails instead of hanging.
        self._sync_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self.input = self._sync_ctx.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.output = self._ctx.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        for s in (self.input, self.output):
            s.setsockopt(zmq.LINGER, 0)
        self.input.bind(f"ipc://{self._dir}/input")
        self.output.bind(f"ipc://{self._dir}/output")
        self.config = m.CoreConfig(model=str(model), engine_kwargs=dict(engine_kwargs),
                                   input_addr=f"ipc://{self._dir}/input", output_addr=f"ipc://{self._dir}/output",
                                   parent_pid=os.getpid(), kv_connector=kv_connector,
                                   kv_connector_config=dict(kv_connector_config or {}))
        self.proc: subprocess.Popen | None = None
        self.closing = False
        self._calls = itertools.count()
        self._replies: dict[int, asyncio.Future] = {}

    async def start(self, timeout: float, on_death: Callable[[str], None]) -> m.Ready:
        """Launch the core and wait for ``Ready``; raise ``EngineDeadError`` with the core's reason
        if it fails to build its engine, exits, or is not ready within ``timeout`` seconds."""
        cfg = msgspec.json.encode(self.config).decode()
        self.proc = subprocess.Popen([sys.executable, "-m", "hwkv.serving.core", cfg], stdin=subprocess.DEVNULL)
        loop = asyncio.get_running_loop()
        proc = self.proc

        def watch() -> None:
            rc = proc.wait()
            if not self.closing:
                loop.call_soon_threadsafe(on_death, f"engine core process exited unexpectedly (exit code {rc})")

        threading.Thread(target=watch, name="hwkv-core-watch", daemon=True).start()
        deadline = loop.time() + timeout
        while True:
            if await self.output.poll(100):
                msg = m.from_core.decode(await self.output.recv())
                if isinstance(msg, m.Ready):
                    return msg
                if isinstance(msg, m.Failed):
                    await self.close()
                    raise EngineDeadError(f"engine core failed to start: {msg.error}")
            elif proc.poll() is not None:
                await self.close()
                raise EngineDeadError(f"engine core process exited during start-up (exit code {proc.returncode})")
            elif loop.time() > deadline:
                await self.close()
                raise EngineDeadError(f"engine core was not ready within {timeout:g} s")

    async def send(self, msg: Any) -> None:
        data = m.encode(msg)
        while True:
            try:
                self.input.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:  # no core connected (yet: it connects during start-up; or any more)
                if self.proc is None or self.proc.poll() is not None:
                    raise EngineDeadError("engine core process is not running") from None
                await asyncio.sleep(0.005)

    async def recv(self) -> Any:
        return m.from_core.decode(await self.output.recv())

    async def utility(self, name: str, timeout: float) -> Any:
        call_id = next(self._calls)
        fut = self._replies[call_id] = asyncio.get_running_loop().create_future()
        try:
            await self.send(m.Utility(call_id, name))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._replies.pop(call_id, None)

    def resolve(self, reply: m.UtilityResult) -> None:
        fut = self._replies.get(reply.call_id)
        if fut is not None and not fut.done():
            if reply.error is not None:
                fut.set_exception(RuntimeError(reply.error))
            else:
                fut.set_result(reply.result)

    def fail_calls(self, error: Exception) -> None:
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(error)

    async def close(self, timeout: float = 5.0) -> None:
        """Ask the core to stop; terminate, then kill it if it does not within ``timeout``."""
        self.closing = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(asyncio.TimeoutError, zmq.ZMQError, EngineDeadError):
                await asyncio.wait_for(self.send(m.Shutdown()), 0.5)
            for stop in (None, proc.terminate, proc.kill):
                if stop is not None:
                    stop()
                try:
                    await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
                    break
                except asyncio.TimeoutError:
                    continue
        self.input.close(0)
        self.output.close(0)
        self._ctx.term()
        self._sync_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

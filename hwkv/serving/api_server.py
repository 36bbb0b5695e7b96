"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics.

Every request runs through :class:`AsyncEngine`; a client that disconnects — mid-stream or while
waiting for a non-streamed answer — cancels its handler, which aborts the request in the engine
core (its KV blocks are freed). Errors use OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request (``param`` names the field), 401 without the API key, 404 for an
unknown model, 503 once the engine core is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hwkv.serving.async_engine import AsyncEngine
from hwkv.serving.client import EngineDeadError
from hwkv.serving.metrics import ServingMetrics
from hwkv.serving.protocol import ChatRequest, CompletionRequest, error_body, param_of
from hwkv.serving.responses import Responder

_json = msgspec.json.encode


def error(message: str, kind: str, code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=code)


def _sse(obj: Any) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


async def _merged(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """``(index, output)`` from several generators as they come; closing this cancels them all
    (each one's cleanup aborts its request)."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        try:
            async for out in gen:
                queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, None, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, out, err = await queue.get()
            if err is done:
                left -= 1
            elif err is not None:
                raise err
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; cancel it (aborting its requests) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it
    return task.result()


class _ApiKey:
    """Pure ASGI (Starlette's BaseHTTPMiddleware would wrap every streamed chunk): 401 on
    ``/v1/*`` and ``/server_info`` without ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/server_info")):
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(got, self.want):
                response = error("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 "AuthenticationError", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, served_model_name: str, api_key: str | None = None,
              metrics: ServingMetrics | None = None) -> FastAPI:
    """The FastAPI app over a started ``engine``."""
    app = FastAPI(title="hwkv", docs_url=None, redoc_url=None)
    names = {served_model_name, engine.model}
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        got = repr(first.get("input"))
        got = got if len(got) <= 200 else got[:200] + "..."
        return error(f"{where}: {first.get('msg')} (got {got})", "BadRequestError", 400, loc[0] if loc else None)

    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)

    def check_model(model: str | None) -> JSONResponse | None:
        if model is None or model in names:
            return None
        return error(f"The model `{model}` does not exist (served: {served_model_name!r})", "NotFoundError",
                     404, "model")

    def unavailable() -> JSONResponse:
        return error(f"the engine is not running: {engine.dead}", "ServiceUnavailableError", 503)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200) if engine.is_running else unavailable()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = engine.info
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "hwkv",
            "root": engine.model, "max_model_len": info.max_model_len if info else None,
        }]}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        """What serves: for benchmarks and operators (not an OpenAI endpoint)."""
        from hwkv import __version__

        info = engine.info
        return {"version": __version__, "model": served_model_name, "root": engine.model,
                **({k: getattr(info, k) for k in ("backend", "device", "vocab_size", "max_model_len", "block_size",
                                                 "num_kv_blocks", "kv_connector")} if info else {})}

    @app.get("/metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if metrics is None:
            return error("metrics are off", "NotFoundError", 404)
        with contextlib.suppress(Exception):  # a dead or busy core: the last snapshot stands
            metrics.update_core(await engine.stats(timeout=2.0))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def run(body: Any, request: Request, chat: bool) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        if not engine.is_running:
            return unavailable()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            responder = Responder(engine, body, rid, served_model_name, chat)
            gens = [engine.generate(p, params, f"{rid}-{i}", body.priority)
                    for i, (p, params) in enumerate(responder.inputs)]
        except EngineDeadError:
            return unavailable()
        except ValueError as e:
            return error(str(e), "BadRequestError", 400, param_of(e, "messages" if chat else "prompt"))
        if body.stream:
            return StreamingResponse(stream(responder, gens), media_type="text/event-stream")
        return await _unless_disconnected(request, complete(responder, gens))

    async def stream(responder: Responder, gens: list[AsyncIterator[Any]]) -> AsyncIterator[bytes]:
        outputs = _merged(gens)
        try:
            for chunk in responder.opening_chunks():
                yield _sse(chunk)
            failed = None
            async for i, out in outputs:
                if out.finish_reason == "error":  # executing it failed: the stream ends with the reason
                    failed = out
                    break
                for chunk in responder.chunks(i, out):
                    yield _sse(chunk)
            if failed is not None:
                yield _sse(error_body(f"request failed: {failed.error}", "InternalServerError", 500))
            elif (usage := responder.usage_chunk()) is not None:
                yield _sse(usage)
        except EngineDeadError as e:
            yield _sse(error_body(str(e), "ServiceUnavailableError", 503))
        except ValueError as e:  # the core refused the request (a race the front end's checks cannot see)
            yield _sse(error_body(str(e), "BadRequestError", 400))
        finally:
            await outputs.aclose()  # the other prompts' requests, if one failed
        yield b"data: [DONE]\n\n"

    async def complete(responder: Responder, gens: list[AsyncIterator[Any]]) -> Response:
        finals: dict[int, Any] = {}
        try:
            async for i, out in _merged(gens):
                if out.finished:
                    finals[i] = out
        except EngineDeadError:
            return unavailable()
        except ValueError as e:
            return error(str(e), "BadRequestError", 400)
        if failed := [o for o in finals.values() if o.finish_reason == "error"]:
            return error(f"request failed: {failed[0].error}", "InternalServerError", 500)
        return JSONResponse(responder.response([finals[i] for i in range(len(gens))]))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await run(body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request) -> Response:
        return await run(body, request, chat=True)

    return app

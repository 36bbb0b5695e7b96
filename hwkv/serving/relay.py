"""What the two OpenAI-compatible fronts over other servers (the P/D proxy, :mod:`hwkv.serving.proxy`,
and the router, :mod:`hwkv.serving.router`) do alike: answer errors in OpenAI's shape, forward the
caller's identity headers, hold one HTTP client to the upstream servers, relay a stream (an upstream
that dies mid-stream is said in-band), and serve ``/v1/completions`` and ``/v1/chat/completions``
so that a client's hang-up cancels the request upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hwkv.serving.disconnect import unless_disconnected

_KINDS = {400: "BadRequestError", 502: "BadGateway", 503: "ServiceUnavailable"}
FORWARDED_HEADERS = ("authorization", "x-request-id")


def error(code: int, message: str) -> JSONResponse:
    """An OpenAI-shaped error body (``type`` by code: 400, 502, 503)."""
    return JSONResponse({"error": {"message": message, "type": _KINDS.get(code, "ServiceUnavailable"), "param": None,
                                   "code": code}}, status_code=code)


def forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}


async def json_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object, or the 400 answer saying why not."""
    try:
        body = await request.json()
    except ValueError:
        return error(400, "the request body is not JSON")
    return body if isinstance(body, dict) else error(400, "the request body must be a JSON object")


class Upstream:
    """One pooled HTTP client to the upstream servers, made on first use (in the app's event loop)."""

    def __init__(self, timeout: httpx.Timeout):
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def unhealthy(self, urls: list[str]) -> list[str]:
        """The servers among ``urls`` whose ``/health`` does not answer 200 within 5 s."""
        bad = []
        for url in urls:
            try:
                if (await self.client().get(f"{url}/health", timeout=5.0)).status_code != 200:
                    bad.append(url)
            except httpx.HTTPError:
                bad.append(url)
        return bad


def relay(r: httpx.Response, who: str, on_end: Callable[[], None] | None = None) -> StreamingResponse:
    """Pass the upstream stream ``r`` through; if ``who`` (e.g. "decode server URL") fails mid-stream
    the client gets an SSE error event naming it. The upstream response is closed (and ``on_end``
    called) when the stream ends, fails or the client goes away."""

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            yield (f'data: {{"error": {{"message": "{who} failed mid-stream: {type(e).__name__}", '
                   f'"type": "BadGateway", "code": 502}}}}\n\n').encode()
        finally:
            if on_end is not None:
                on_end()
            await r.aclose()

    return StreamingResponse(chunks(), media_type=r.headers.get("content-type", "text/event-stream"))


def add_openai_routes(app: FastAPI, handle: Callable[[Request, str], Awaitable[Response]]) -> None:
    """``POST /v1/completions`` and ``/v1/chat/completions`` through ``handle(request, path)``. The
    body is read first, so that the disconnect watch sees only a hang-up; a client that hangs up on
    a non-streamed request cancels ``handle`` (its upstream connections close: the server aborts)."""

    async def handle_or_abort(request: Request, path: str) -> Response:
        await request.body()
        return await unless_disconnected(request, handle(request, path))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle_or_abort(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle_or_abort(request, "/v1/chat/completions")

"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, tokenize /
detokenize, version, health, metrics.

Every request runs through :class:`AsyncEngine`; a client that disconnects — mid-stream or while
waiting for a non-streamed answer — cancels its handler, which aborts the request in the engine
core (its KV blocks are freed). Errors use OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request (``param`` names the field), 401 without the API key, 404 for an
unknown model or path, 413 for a body over the limit, 503 once the engine core is gone (or stalls).

The request path keeps the event loop free: the body is read up to ``max_body_bytes``, then parsed
(msgspec), validated (pydantic), length-checked and tokenized on a bounded worker pool, so a
multi-megabyte prompt delays only itself — never ``/health`` or other requests' streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from hwkv import __version__
from hwkv.serving.async_engine import AsyncEngine
from hwkv.serving.client import EngineDeadError
from hwkv.serving.disconnect import unless_disconnected
from hwkv.serving.metrics import ServingMetrics
from hwkv.serving.protocol import (
    BadRequest,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    param_of,
)
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


class _ApiKey:
    """Pure ASGI (Starlette's BaseHTTPMiddleware would wrap every streamed chunk): 401 on
    ``/v1/*``, ``/server_info``, ``/tokenize`` and ``/detokenize`` without ``Authorization: Bearer <key>``."""

    def __init__(self, app: Any, key: str):
        self.app, self.want = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/server_info", "/tokenize", "/detokenize")):
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(got, self.want):
                response = error("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                 "AuthenticationError", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


@dataclass
class ServingLimits:
    """What one request may cost the API process (``hwkv serve`` flags of the same names).

    ``max_body_bytes``: the request body (413 beyond). ``max_prompt_chars``: a prompt's (or the
    rendered chat's) length in characters, checked before tokenizing (``None``: ``max_model_len``
    × the longest token of the vocabulary — a longer text cannot fit, whatever it encodes to).
    ``workers``: threads that parse, validate and tokenize requests. ``health_deadline_s``:
    ``/health`` turns 503 when the engine core has not been heard from for this long (it
    reports at least every second, idle or busy; a frozen or wedged core stops)."""

    max_body_bytes: int = 32 << 20
    max_prompt_chars: int | None = None
    workers: int = 4
    health_deadline_s: float = 20.0
    shutdown_grace_s: float = 5.0


def _validation_error(exc: ValidationError | RequestValidationError) -> BadRequest:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    where = ".".join(loc) or "body"
    got = repr(first.get("input"))
    got = got if len(got) <= 200 else got[:200] + "..."
    return BadRequest(f"{where}: {first.get('msg')} (got {got})", loc[0] if loc else None)


def _surrogate_path(raw: bytes) -> tuple[str, str | None]:
    """Where the first string with a lone UTF-16 surrogate is (``messages.0.content``), and its top field."""
    def walk(v: Any, path: list[str]) -> list[str] | None:
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path
            return None
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, x in items:
            if isinstance(k, str):
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return [*path, "<key>"]
            if (found := walk(x, [*path, str(k)])) is not None:
                return found
        return None

    try:
        found = walk(json.loads(raw), [])
    except (ValueError, RecursionError):
        found = None
    if not found:
        return "body", None
    return ".".join(found), found[0]


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """The validated body; ``BadRequest`` says what is wrong (and names the field where there is one)."""
    try:
        obj = msgspec.json.decode(raw)
    except UnicodeDecodeError as e:
        raise BadRequest(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start}); allowed: "
                         "JSON text in UTF-8") from None
    except RecursionError:
        raise BadRequest("the request body nests JSON too deeply (allowed: a few hundred levels)") from None
    except msgspec.DecodeError as e:
        if "surrogate" in str(e):
            where, param = _surrogate_path(raw)
            raise BadRequest(f"{where}: the text holds a lone UTF-16 surrogate escape ({e}); allowed: valid "
                             "Unicode (a surrogate pair, or the character itself)", param) from None
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None
    except RecursionError:
        raise BadRequest("the request body nests JSON too deeply (allowed: a few hundred levels)") from None


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token decodes to (the bound behind the default ``max_prompt_chars``)."""
    if tokenizer is None:
        return 0
    vocab = tokenizer._tok.get_vocab(with_added_tokens=True)
    # byte-level BPE spells bytes as printable characters: a token's text is never longer than its name
    return max((len(t) for t in vocab), default=1)


def build_app(engine: AsyncEngine, served_model_name: str | list[str], api_key: str | None = None,
              metrics: ServingMetrics | None = None, limits: ServingLimits | None = None,
              tool_parser: str | None = None) -> FastAPI:
    """The FastAPI app over a started ``engine``. ``served_model_name``: the id (or ids; the first is
    listed and reported) clients send."""
    app = FastAPI(title="hwkv", docs_url=None, redoc_url=None)
    served = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    name = served[0]
    names = {*served, engine.model}
    created = int(time.time())
    limits = limits or ServingLimits()
    max_chars = limits.max_prompt_chars
    if max_chars is None and engine.info is not None and engine.tokenizer is not None:
        max_chars = engine.info.max_model_len * max(longest_token_chars(engine.tokenizer), 1)
    pool = ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="hwkv-request")
    app.state.pool = pool
    app.state.shutting_down = False

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        bad = _validation_error(exc)
        return error(str(bad), "BadRequestError", 400, bad.param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "BadRequestError")
        return error(str(exc.detail), kind, exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        return error(f"internal error: {type(exc).__name__}: {exc}", "InternalServerError", 500)

    if api_key is not None:
        app.add_middleware(_ApiKey, key=api_key)

    def check_model(model: str | None) -> JSONResponse | None:
        if model is None or model in names:
            return None
        return error(f"The model `{model}` does not exist (served: {', '.join(map(repr, served))})",
                     "NotFoundError", 404, "model")

    def unavailable() -> JSONResponse:
        return error(f"the engine is not running: {engine.dead}", "ServiceUnavailableError", 503)

    async def read_body(request: Request) -> bytes:
        """The body, refusing (413) past ``max_body_bytes`` without reading the rest."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            raise _TooLarge(int(size))
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limits.max_body_bytes:
                raise _TooLarge(n)
            chunks.append(chunk)
        return b"".join(chunks)

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def parsed(request: Request, model: type[BaseModel]) -> Any:
        raw = await read_body(request)
        return await off_loop(parse_body, raw, model)

    def too_large(e: _TooLarge) -> JSONResponse:
        return error(f"the request body is {e.size} bytes or more, over this server's limit of "
                     f"{limits.max_body_bytes} (--max-body-bytes)", "BadRequestError", 413)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return unavailable()
        silent = engine.core_silent_s()
        if silent > limits.health_deadline_s:
            return error(f"the engine core has not reported for {silent:.1f} s (deadline "
                         f"{limits.health_deadline_s:g} s): it is stalled", "ServiceUnavailableError", 503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = engine.info
        return {"object": "list", "data": [{
            "id": n, "object": "model", "created": created, "owned_by": "hwkv",
            "root": engine.model, "max_model_len": info.max_model_len if info else None,
        } for n in served]}

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        """What serves: for benchmarks and operators (not an OpenAI endpoint)."""

        info = engine.info
        return {"version": __version__, "model": name, "root": engine.model,
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

    def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tok = engine.tokenizer
        if tok is None:
            raise BadRequest("this model directory has no tokenizer.json", "prompt")
        if body.messages is not None:
            if body.prompt is not None:
                raise BadRequest("give prompt or messages, not both", "messages")
            if not (body.chat_template or tok.chat_template):
                raise BadRequest("this model has no chat template (pass chat_template)", "messages")
            try:
                text = tok.apply_chat_template([m.as_dict() for m in body.messages], body.add_generation_prompt,
                                               template=body.chat_template, tools=body.tools,
                                               **(body.chat_template_kwargs or {}))
            except Exception as e:
                raise BadRequest(f"messages could not be rendered by the chat template: {e}", "messages") from None
            special = bool(body.add_special_tokens)
        elif body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
        else:
            raise BadRequest("give prompt (text) or messages", "prompt")
        if max_chars is not None and len(text) > max_chars:
            raise BadRequest(f"prompt is {len(text)} characters, more than this server accepts ({max_chars})", "prompt")
        try:
            ids = tok.encode(text, add_special_tokens=special)
        except Exception as e:
            raise BadRequest(f"prompt cannot be tokenized ({type(e).__name__}: {e})", "prompt") from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.id_to_token(t) for t in ids]
        return out

    def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tok, vocab = engine.tokenizer, engine.info.vocab_size
        if tok is None:
            raise BadRequest("this model directory has no tokenizer.json", "tokens")
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (allowed: 0..{vocab - 1})", "tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    async def utility(request: Request, model: type[BaseModel], fn: Callable[[Any], dict[str, Any]]) -> Response:
        try:
            body = await parsed(request, model)
            if (bad := check_model(body.model)) is not None:
                return bad
            return JSONResponse(await off_loop(fn, body))
        except _TooLarge as e:
            return too_large(e)
        except BadRequest as e:
            return error(str(e), "BadRequestError", 400, e.param)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await utility(request, TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await utility(request, DetokenizeRequest, detokenize)

    def prepare(body: Any, rid: str, chat: bool) -> tuple[Responder, list[AsyncIterator[Any]]]:
        """On a worker thread: render, check lengths, tokenize, validate; the requests' iterators."""
        responder = Responder(engine, body, rid, name, chat, max_chars, tool_parser)
        gens = [engine.generate(p, params, f"{rid}-{i}", body.priority)
                for i, (p, params) in enumerate(responder.inputs)]
        return responder, gens

    async def run(request: Request, chat: bool) -> Response:
        try:
            body = await parsed(request, ChatRequest if chat else CompletionRequest)
        except _TooLarge as e:
            return too_large(e)
        except BadRequest as e:
            return error(str(e), "BadRequestError", 400, e.param)
        if (bad := check_model(body.model)) is not None:
            return bad
        if not engine.is_running:
            return unavailable()
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            responder, gens = await off_loop(prepare, body, rid, chat)
        except EngineDeadError:
            return unavailable()
        except ValueError as e:
            return error(str(e), "BadRequestError", 400, param_of(e, "messages" if chat else "prompt"))
        if body.stream:
            return StreamingResponse(stream(responder, gens), media_type="text/event-stream")
        return await unless_disconnected(request, complete(responder, gens))

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
        except ValueError as e:  # the core refused it (the front end's checks cannot see every race)
            return error(str(e), "BadRequestError", 400, param_of(e, None))
        if failed := [o for o in finals.values() if o.finish_reason == "error"]:
            return error(f"request failed: {failed[0].error}", "InternalServerError", 500)
        return JSONResponse(responder.response([finals[i] for i in range(len(gens))]))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run(request, chat=True)

    return app


class _TooLarge(Exception):
    def __init__(self, size: int):
        self.size = size

"""Disaggregated-serving proxy: OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``
in front of prefill servers (``hwkv serve`` with the p2p connector as producer) and decode servers
(consumer), as vLLM's disaggregated proxy examples do:

1. the request goes to a prefill server (round-robin) with ``max_tokens=1``, ``stream=false`` and
   ``kv_transfer_params={"do_remote_decode": true}``; its response carries ``kv_transfer_params``
   (where the prompt's KV is held);
2. the original request goes to a decode server (round-robin) with those ``kv_transfer_params``;
   its response (or SSE stream) is passed through unchanged.

With ``side_channels`` (``--layerwise``: the prefill servers' p2p side-channel addresses, one per
prefill URL) the flow is consumer first, as vllm-ascend's layerwise proxy: the decode request goes
out at once with ``{"do_remote_prefill": true, "mode": "push", "remote_host", "remote_port",
"transfer_id"}``, so the decode server announces its blocks to the producer, and the prefill request
(``{"do_remote_decode": true, "transfer_id"}``) runs beside it; a layerwise producer then writes each
layer's KV as its forward writes it.

A client that disconnects is followed: a stream's relay closes its decode connection, a
non-streamed request is cancelled (its connections closed), so the servers abort the request.

Failures are answered, never hung on: an unreachable side is 503, a side that answers with a
server error (or a prefill server without a producer connector) is 502, each with a body naming
the side and URL; a client error (4xx) of either side is passed through as it came.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from hwkv.serving.relay import Upstream, add_openai_routes, error, forward_headers, json_body, relay


class _Failed(Exception):
    def __init__(self, response: Response):
        self.response = response


log = logging.getLogger(__name__)


def build_proxy(prefill: list[str], decode: list[str], timeout_s: float = 600.0,
                side_channels: list[str] | None = None) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("the proxy needs at least one prefill and one decode URL")
    if side_channels is not None and len(side_channels) != len(prefill):
        raise ValueError(f"{len(side_channels)} prefill side channels for {len(prefill)} prefill URLs "
                         "(allowed: one host:port per prefill URL, in the same order)")
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    next_p, next_d = itertools.cycle(range(len(prefill))), itertools.cycle(decode)
    timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
    app = FastAPI(title="hwkv proxy")
    state: dict[str, Any] = {}
    upstream = Upstream(timeout)
    client = upstream.client

    async def post(side: str, url: str, body: dict[str, Any], hdrs: dict[str, str]) -> httpx.Response:
        try:
            r = await client().post(url, json=body, headers=hdrs)
        except httpx.TimeoutException:
            raise _Failed(error(503, f"{side} server {url} did not answer within {timeout_s:g} s")) from None
        except httpx.HTTPError as e:
            raise _Failed(error(503, f"{side} server {url} is unreachable ({type(e).__name__}: {e})")) from None
        if r.status_code >= 500:
            raise _Failed(error(502, f"{side} server {url} failed with HTTP {r.status_code}: {r.text[:500]}"))
        if r.status_code >= 400:
            raise _Failed(Response(r.content, r.status_code, media_type=r.headers.get("content-type")))
        return r

    def prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
        pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pre.update(max_tokens=1, stream=False, kv_transfer_params=params)
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        return pre

    async def prefill_step(path: str, body: dict[str, Any], hdrs: dict[str, str]) -> dict[str, Any]:
        url = f"{prefill[next(next_p)]}{path}"
        r = await post("prefill", url, prefill_body(body, {"do_remote_decode": True}), hdrs)
        try:
            params = r.json().get("kv_transfer_params")
        except ValueError:
            params = None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):  # e.g. echoed back unused
            raise _Failed(error(502, f"prefill server {url} returned no kv_transfer_params (is it serving with "
                                      "--kv-connector p2p and role 'producer'?)"))
        return params

    async def handle(request: Request, path: str) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            return body
        hdrs = forward_headers(request)
        try:
            if side_channels is not None:
                params = consumer_first(path, body, hdrs)
            else:
                params = await prefill_step(path, body, hdrs)
            url = f"{next(next_d)}{path}"
            dec = dict(body, kv_transfer_params=params)
            if not body.get("stream"):
                return await decode_step(url, dec, hdrs)
            return await stream(url, dec, hdrs)
        except _Failed as f:
            return f.response

    async def decode_step(url: str, body: dict[str, Any], hdrs: dict[str, str]) -> Response:
        try:
            r = await post("decode", url, body, hdrs)
        except _Failed as f:
            return f.response
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    def consumer_first(path: str, body: dict[str, Any], hdrs: dict[str, str]) -> dict[str, Any]:
        i, tid = next(next_p), uuid.uuid4().hex
        host, port = side_channels[i].rsplit(":", 1)  # type: ignore[index]
        task = asyncio.ensure_future(post("prefill", f"{prefill[i]}{path}",
                                          prefill_body(body, {"do_remote_decode": True, "transfer_id": tid}), hdrs))
        state.setdefault("tasks", set()).add(task)

        def done(t: asyncio.Future) -> None:
            state["tasks"].discard(t)
            if not t.cancelled() and t.exception() is not None:  # the decode server recomputes
                log.warning("prefill for transfer %s failed: %s", tid, t.exception())

        task.add_done_callback(done)
        return {"do_remote_prefill": True, "mode": "push", "remote_host": host, "remote_port": int(port),
                "transfer_id": tid}

    async def stream(url: str, body: dict[str, Any], hdrs: dict[str, str]) -> Response:
        req = client().build_request("POST", url, json=body, headers=hdrs)
        try:
            r = await client().send(req, stream=True)
        except httpx.HTTPError as e:
            return error(503, f"decode server {url} is unreachable ({type(e).__name__}: {e})")
        if r.status_code >= 400:
            content = await r.aread()
            await r.aclose()
            if r.status_code >= 500:
                return error(502, f"decode server {url} failed with HTTP {r.status_code}: {content[:500]!r}")
            return Response(content, r.status_code, media_type=r.headers.get("content-type"))

        return relay(r, f"decode server {url}")  # a client that hangs up closes the decode connection

    add_openai_routes(app, handle)  # a non-streamed request whose client hangs up is cancelled (aborted upstream)

    @app.get("/health")
    async def health() -> Response:
        bad = await upstream.unhealthy(prefill + decode)
        if bad:
            return error(503, f"unhealthy: {', '.join(bad)}")
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        url = f"{decode[0]}/v1/models"
        try:
            r = await client().get(url, headers=forward_headers(request))
        except httpx.HTTPError as e:
            return error(503, f"decode server {url} is unreachable ({type(e).__name__}: {e})")
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    return app

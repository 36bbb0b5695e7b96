"""`hwkv proxy`: a non-streamed client that hangs up is followed to the decode server (which then
aborts the request), instead of the decode running on for nobody."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from server_utils import free_port

from hwkv.serving.disconnect import unless_disconnected
from hwkv.serving.proxy import build_proxy

pytestmark = pytest.mark.timeout(60)


class Background:
    """A uvicorn server on a thread, on a free 127.0.0.1 port."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def test_non_streamed_client_disconnect_aborts_on_the_decode_server():
    seen: list[int] = []
    prefill, decode = FastAPI(), FastAPI()

    @prefill.post("/v1/completions")
    async def pre(request: Request):
        await request.json()
        return JSONResponse({"choices": [], "kv_transfer_params": {"do_remote_prefill": True, "id": 1}})

    @decode.post("/v1/completions")
    async def dec(request: Request):
        body = await request.json()
        assert body["kv_transfer_params"]["do_remote_prefill"]

        async def work():
            await asyncio.sleep(30)  # a long generation
            return JSONResponse({"choices": []})

        r = await unless_disconnected(request, work())  # as hwkv serve: a hang-up cancels the work
        seen.append(r.status_code)
        return r

    servers = [Background(prefill), Background(decode)]
    proxy = Background(build_proxy([servers[0].url], [servers[1].url], timeout_s=60))
    servers.append(proxy)
    try:
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5000},
                       timeout=httpx.Timeout(10, read=0.5))
        deadline = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < deadline, "the decode server never saw the client leave"
            time.sleep(0.05)
        assert seen == [499] and time.monotonic() - t0 < 10  # aborted, not run to the end (30 s)
    finally:
        for s in servers:
            s.stop()

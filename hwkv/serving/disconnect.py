"""Follow a client's disconnect while a non-streamed answer is being computed (Starlette cancels
nothing by itself until the response is sent)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import Response


async def unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; cancel it if the client disconnects first (its cleanup aborts what it started)."""

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

"""Relaying one request's scheduler events to an HTTP response."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import StreamingResponse

from poly.serving import RequestDone, RequestFailed


async def _cancel_when_gone(request: Request, handle) -> None:
    """Cancels the request when the server reports its client gone. With the body read, the
    ASGI server's next message is ``http.disconnect`` (sent when the connection drops), so
    this waits on that event instead of polling between tokens."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()  # the scheduler drops it, and frees its KV, at its next step
            return


async def events(handle, q: asyncio.Queue, request: Request | None = None):
    """The request's events; with ``request``, a client that goes away cancels it (streaming
    or not, queued or generating)."""
    watcher = None
    if request is not None:
        watcher = asyncio.ensure_future(_cancel_when_gone(request, handle))
    try:
        while True:
            ev = await q.get()
            yield ev
            if isinstance(ev, (RequestDone, RequestFailed)):
                return
    finally:
        if watcher is not None:
            watcher.cancel()
        if not handle.finished:
            handle.cancel()


def streaming(gen) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(gen, media_type="text/event-stream", headers=headers)

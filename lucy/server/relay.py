"""Relaying one request's scheduler events to an HTTP response."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import StreamingResponse

from poly.serving import RequestDone, RequestFailed


async def events(handle, q: asyncio.Queue, request: Request | None = None):
    """The request's events; with ``request``, a client that goes away cancels it."""
    try:
        while True:
            if request is None:
                ev = await q.get()
            else:
                try:
                    ev = await asyncio.wait_for(q.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                        return
                    continue
            yield ev
            if isinstance(ev, (RequestDone, RequestFailed)):
                return
    finally:
        if not handle.finished:
            handle.cancel()


def streaming(gen) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(gen, media_type="text/event-stream", headers=headers)

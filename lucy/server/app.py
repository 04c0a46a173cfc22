"""The FastAPI app of ``lucy serve``: OpenAI-compatible routes over one ``Scheduler``.

HTTP handlers only parse, submit and relay: the scheduler's own thread owns the model. Each
request's events come back through ``loop.call_soon_threadsafe`` into an asyncio queue; a request
whose client disconnects, streaming or not, is cancelled (freed at the scheduler's next step).
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lucy.server import page, routes
from lucy.server.errors import ApiError, bad_request
from lucy.server.metrics import prometheus_text
from lucy.server.state import REQUEST, ServerState

log = logging.getLogger("lucy.server")


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


class RequestLog:
    """One INFO line per request on the ``lucy.server`` logger, when its response has ended:
    method, path, status, prompt+completion tokens, milliseconds (`--log-level info`)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rec: dict = {"status": 500}  # what the client gets when the app raises
        token = REQUEST.set(rec)
        start = time.perf_counter()

        async def send_status(message):
            if message["type"] == "http.response.start":
                rec["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            REQUEST.reset(token)
            ms = (time.perf_counter() - start) * 1e3
            usage = rec.get("usage")
            tokens = "-" if usage is None else f"{usage.prompt_tokens}+{usage.completion_tokens}"
            log.info("%s %s %d %s tokens %.0f ms", scope["method"], scope["path"],
                     rec["status"], tokens, ms)  # fmt: skip


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.scheduler.start()
        yield
        state.draining = True
        await run_in_threadpool(state.scheduler.shutdown, state.drain_s)

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_middleware(RequestLog)
    _add_error_handlers(app)
    page.add_routes(app)  # the chat page at /
    _add_status_routes(app, state)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await routes.chat(state, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await routes.completions(state, request)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error, ours or FastAPI's, answered as an OpenAI-style JSON error body."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError):
        if err.param == "messages" and request.url.path == "/v1/completions":
            err.param = "prompt"  # poly's context errors do not know the route's field name
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(ApiError(err.status_code, str(err.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return _error_response(bad_request("invalid request"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):
        return _error_response(ApiError(500, "internal server error", "server_error"))


def _add_status_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /metrics and /v1/models: the server's state, no generation."""

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics(request: Request):
        state.check_auth(request)
        return PlainTextResponse(
            prometheus_text(state.scheduler), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models(request: Request):
        state.check_auth(request)
        card = {
            "id": state.model_id,
            "object": "model",
            "created": state.created,
            "owned_by": "poly",
            # as llama.cpp's server adds "meta": what a request that leaves fields out runs
            # with (the chat page shows them); OpenAI's clients ignore unknown fields
            "meta": {"context": state.scheduler.max_context, "defaults": state.defaults},
        }
        return {"object": "list", "data": [card]}

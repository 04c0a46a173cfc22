"""The chat page at ``/``: three static files shipped in the package (lucy/server/static/), read
once. The page only calls the public API (/v1/models, /v1/chat/completions), so it is served
without the API key: it asks for the key itself and keeps it in the tab's sessionStorage."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from lucy.server.errors import ApiError

ASSETS = {
    "chat.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
# Same-origin only: the page loads nothing from elsewhere (it works offline), and an injected
# script or a form pointed at another host is refused by the browser too.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


@cache
def asset(name: str) -> bytes:
    return (resources.files("lucy.server") / "static" / name).read_bytes()


def _response(name: str) -> Response:
    return Response(asset(name), media_type=ASSETS[name], headers=HEADERS)


def add_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def index():
        return _response("chat.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in ASSETS or name == "chat.html":
            raise ApiError(404, "not found", "not_found_error")
        return _response(name)

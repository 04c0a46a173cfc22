"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from poly.errors import (
    ContextOverflowError,
    GenerationError,
    PeerLostError,
    PolyError,
    QueueFullError,
    SamplingParamsError,
    TemplateError,
    TokenizerError,
    UsageError,
)


class ApiError(Exception):
    """An error the client sees: HTTP ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 close: bool = False):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code,
        )  # fmt: skip
        self.close = close  # the request was not read to its end: close the connection after

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"} if self.close else {}

    def body(self) -> dict:
        msg = " ".join(str(self.message).split())[:2000]  # one line, bounded, never a traceback
        return {
            "error": {"message": msg, "type": self.type, "param": self.param, "code": self.code}
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def from_poly(err: PolyError) -> ApiError:
    """The HTTP error for a poly error raised while handling a request."""
    if isinstance(err, PeerLostError):  # a tensor-parallel rank died: this server is done
        return ApiError(503, f"the server lost a rank: {err}", "server_error", None, err.code)
    if isinstance(err, QueueFullError):
        return ApiError(429, str(err), "rate_limit_error", None, "queue_full")
    if isinstance(err, ContextOverflowError):
        return ApiError(
            400, str(err), "invalid_request_error", "messages", "context_length_exceeded"
        )
    if isinstance(err, (SamplingParamsError, UsageError, TemplateError, TokenizerError)):
        return bad_request(str(err), code=err.code)
    if isinstance(err, GenerationError) and err.code in ("invalid_token",):
        return bad_request(str(err), "prompt", err.code)
    return ApiError(500, f"generation failed: {err.code}", "server_error", None, err.code)

"""What ``lucy serve`` bounds before a request reaches a handler: the number of open
connections, the request head's size and read time (uvicorn's httptools protocol has none of
them) and the nesting depth of request JSON.

httptools gathers a header value inside the parser until its line ends, so the head is counted
on the bytes received, not on parsed headers: a 64 MB header costs at most one socket read more
than ``max_head`` before the connection gets 431 and is closed.
"""

from __future__ import annotations

import json
import re
import resource

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_HEAD = 32 << 10  # bytes of request line + headers (h11's own default is 16 KiB)
HEAD_TIMEOUT = 10.0  # seconds from the connection (or the next request's first byte) to its head
BODY_TIMEOUT = 60.0  # seconds from the head to the end of the body
MAX_JSON_DEPTH = 64  # nested arrays/objects in a request body
MAX_CONNECTIONS = 256  # open client connections (lowered to what the fd limit leaves)
FD_HEADROOM = 64  # descriptors kept for the model files, the listener, logs and the event loop

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string (unrolled: linear time)


class _HeadRejected(Exception):
    """Raised inside the parser's callback to stop it after the 431 is sent."""


def fd_room() -> int:
    """Client connections the process's open-file limit (``ulimit -n``) leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (1 << 30) if soft == resource.RLIM_INFINITY else soft - FD_HEADROOM


def default_max_connections() -> int:
    return max(1, min(MAX_CONNECTIONS, fd_room()))


def _error_bytes(status: int, message: str, code: str) -> bytes:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    error = {"message": message, "type": type_, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    head = [
        STATUS_LINE[status],
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


class LimitedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a cap on open connections (503 at once, then closed),
    on the request head's bytes (431) and on the time a client takes to send it (408, then the
    connection is closed)."""

    max_head = MAX_HEAD
    head_timeout = HEAD_TIMEOUT
    max_connections: int | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_open, self._head_bytes, self._size, self._rejected = True, 0, 0, False
        self._heads = 0  # heads parsed on this connection
        self._head_timer = None
        self._arm_head_timer()  # a connection that never sends a byte is closed too
        # answered before its request is read, so one over the cap holds a descriptor only
        # while the 503 is written (uvicorn's limit_concurrency waits for the head)
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            message = f"the server has {self.max_connections} open connections; retry later"
            self._reject(503, message, "too_many_connections")

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        counted, heads = self._head_open, self._heads  # a read that begins inside a head
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if not self._rejected:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        if counted and self._heads == heads:  # the whole read went to one unfinished head
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head:
                self._reject(431, f"request head over {self.max_head} bytes", "header_too_large")

    # parser callbacks ------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_open, self._head_bytes, self._size = True, 0, 0
        self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_open, self._heads = False, self._heads + 1
        self._cancel_head_timer()
        if self._size > self.max_head:  # a big head that came in one read
            self._reject(431, f"request head over {self.max_head} bytes", "header_too_large")
            raise _HeadRejected
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes = True, 0  # the next request's head may follow

    # limits ----------------------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        timer, self._head_timer = getattr(self, "_head_timer", None), None
        if timer is not None:
            timer.cancel()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._head_open or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a response is under way: close after it
            return
        self._reject(408, f"request head not received within {self.head_timeout:g} s",
                     "header_timeout")  # fmt: skip

    def _reject(self, status: int, message: str, code: str) -> None:
        self._rejected = True
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_error_bytes(status, message, code))
            self.transport.close()


def protocol(max_head: int = MAX_HEAD, head_timeout: float = HEAD_TIMEOUT,
             max_connections: int | None = None) -> type:  # fmt: skip
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""
    limits = {"max_head": max_head, "head_timeout": head_timeout,
              "max_connections": max_connections}  # fmt: skip
    return type("LimitedHttpTools", (LimitedHttpTools,), limits)


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether arrays/objects in ``raw`` nest deeper than ``limit`` (brackets inside strings
    skipped), counted on the bytes before any parser recurses."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # too few brackets to nest that deep
    import numpy as np

    bare = np.frombuffer(_STRING.sub(b'""', raw), dtype=np.uint8)
    step = (bare == ord("[")).astype(np.int32) + (bare == ord("{"))
    step -= (bare == ord("]")).astype(np.int32) + (bare == ord("}"))
    return int(np.cumsum(step).max(initial=0)) > limit

"""What every ``lucy serve`` handler shares: the scheduler, the model's names, the API key."""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import json
import threading
import time
import uuid

from fastapi import Request

from lucy.server.errors import ApiError, bad_request, from_poly
from lucy.server.limits import BODY_TIMEOUT, MAX_JSON_DEPTH, json_too_deep
from lucy.server.protocol import model_defaults
from poly.errors import PolyError
from poly.serving import RequestDone, Scheduler

# The request being handled, for its log line (lucy.server.app.RequestLog): status, usage.
REQUEST: contextvars.ContextVar[dict | None] = contextvars.ContextVar("lucy_request", default=None)
MAX_BODY = 4 << 20  # bytes; larger bodies get 413
DRAIN_LIMIT = 64 << 20  # a too-large body is read and dropped up to this size


class Mailbox:
    """Scheduler-thread events into the event loop's queues, one loop wake-up per burst: a
    decode step yields a token for each of its rows, and `call_soon_threadsafe` per token wrote
    the loop's self-pipe once each (6 % of the scheduler thread at 8 streams, in py-spy)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list = []

    def post(self, q: asyncio.Queue, ev) -> None:
        with self._lock:
            self._pending.append((q, ev))
            if len(self._pending) > 1:
                return  # a drain is already scheduled
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for q, ev in pending:
            q.put_nowait(ev)


class ServerState:
    """What every handler needs: the scheduler, the served model's names, the key."""

    def __init__(self, scheduler: Scheduler, model_id: str, aliases=(), api_key: str | None = None,
                 max_body: int = MAX_BODY, drain_s: float = 30.0,
                 body_timeout: float = BODY_TIMEOUT, max_depth: int = MAX_JSON_DEPTH):  # fmt: skip
        self.scheduler = scheduler
        self.model = scheduler.model
        self.model_id = model_id
        self.aliases = {model_id, *aliases}
        self.api_key = api_key
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.max_depth = max_depth
        self.drain_s = drain_s
        self.created = int(time.time())
        self.draining = False
        self.down: str | None = None  # why it stopped serving for good (a lost TP rank)
        self.grammars = None  # llguidance's tokenizer, built on the first structured request
        self.defaults = model_defaults(self.model)  # what a request leaves out (gendefaults)
        self._mailbox: Mailbox | None = None

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        want = f"Bearer {self.api_key}"
        if not hmac.compare_digest(got.encode(), want.encode()):
            raise ApiError(401, "invalid or missing API key", "authentication_error", None,
                           "invalid_api_key")  # fmt: skip

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                           f"'{self.model_id}'", "invalid_request_error", "model",
                           "model_not_found")  # fmt: skip

    async def read_json(self, request: Request):
        try:
            async with asyncio.timeout(self.body_timeout):
                raw = await self._read_body(request)
        except TimeoutError:
            raise ApiError(408, f"request body not received within {self.body_timeout:g} s",
                           code="body_timeout", close=True) from None  # fmt: skip
        if json_too_deep(raw, self.max_depth):  # before json (or a template) recurses into it
            raise bad_request(f"the body nests arrays/objects deeper than {self.max_depth}",
                              code="json_too_deep")  # fmt: skip
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            raise bad_request(f"the body is not valid JSON: {err}", code="invalid_json") from None

    async def _read_body(self, request: Request) -> bytes:
        chunks, total, too_big = [], 0, False
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body:
            too_big = True
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_body:
                too_big, chunks = True, []
            if too_big and total > DRAIN_LIMIT:
                break  # past this, the client sees the connection close instead of the 413
            if not too_big:
                chunks.append(chunk)
        if too_big:  # read (and dropped) so that the client gets to read the answer
            raise ApiError(
                413, f"request body exceeds {self.max_body} bytes", code="body_too_large"
            )
        return b"".join(chunks)

    def submit(self, ids, params, mask_factory=None):
        """(handle, asyncio queue of its events)."""
        if self.draining:
            why, code = (self.down, "rank_lost") if self.down else ("shutting down", "unavailable")
            raise ApiError(503, f"the server is {why}", "server_error", None, code)
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = Mailbox(loop)
        q: asyncio.Queue = asyncio.Queue()
        box = self._mailbox
        rec = REQUEST.get()
        slots = getattr(self, "slots", None)  # lucy/server/slots.py: the slot this request takes
        slot = None if slots is None else slots.open(params, ids)

        def notify(ev) -> None:
            if rec is not None and isinstance(ev, RequestDone):
                rec["usage"] = ev.usage
            if slot is not None:
                slot.see(ev)
            box.post(q, ev)

        try:
            handle = self.scheduler.submit(ids, params, mask_factory=mask_factory, notify=notify,
                                           rid=uuid.uuid4().hex[:24])  # fmt: skip
        except PolyError as err:
            if slot is not None:
                slots.close(slot, None)
            raise from_poly(err) from None
        return handle, q

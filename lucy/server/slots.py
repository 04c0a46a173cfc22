"""llama.cpp's slot save/restore for ``lucy serve``: ``POST /slots/{id}?action=save|restore|erase``.

poly batches requests over one paged KV pool instead of fixed slots, so a slot here is a record:
the token ids whose KV the last request run in it left (prompt and reply but the reply's last
token, which no pass has run yet). A request takes the slot its ``id_slot`` names (llama.cpp's
field), else the lowest idle one. ``save`` writes those positions (from the pool's prefix cache)
to ``--slot-save-path``/filename in poly's KV state format; ``restore`` reads such a file back
into the prefix cache, so the next prompt that starts with its ids takes them without a prefill;
``erase`` forgets the record and its unreferenced cached pages. File names are bare names inside
that folder: a path, a dot name or a NUL is refused.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from lucy.server.errors import ApiError, bad_request
from poly.errors import ContextOverflowError, ModelNotFoundError, PolyError, StateFileError
from poly.serving import RequestDone, RequestFailed, TokenOut

MAX_NAME = 200


class Slot:
    """One request's watch on its slot: choice 0's token ids, recorded when it ends."""

    def __init__(self, table: SlotTable, index: int, prompt: list[int]):
        self.table, self.index, self.prompt = table, index, list(prompt)
        self.generated: list[int] = []

    def see(self, ev) -> None:  # on the scheduler thread
        if isinstance(ev, TokenOut) and ev.index == 0:
            self.generated.append(ev.token_id)
        elif isinstance(ev, RequestDone):  # cancelled before its first token: no KV to keep
            kept = [*self.prompt, *self.generated[:-1]] if self.generated else None
            self.table.close(self, kept)  # the reply's last token: not run yet
        elif isinstance(ev, RequestFailed):
            self.table.close(self, None)


class SlotTable:
    """``n`` slots: which are busy, and each one's cached token ids."""

    def __init__(self, n: int, folder: str | None):
        self.n = n
        self.folder = None if folder is None else Path(folder)
        self.tokens: list[list[int] | None] = [None] * n
        self.busy = [0] * n
        self._lock = threading.Lock()

    def open(self, params, prompt: list[int]) -> Slot | None:
        want = (params.extra or {}).get("id_slot")
        with self._lock:
            if want is None or want < 0:
                idle = [i for i in range(self.n) if not self.busy[i]]
                if not idle:
                    return None
                want = idle[0]
            elif want >= self.n:
                raise bad_request(f"id_slot must be in 0..{self.n - 1} (or -1: any)", "id_slot")
            self.busy[want] += 1
        return Slot(self, want, prompt)

    def close(self, slot: Slot, tokens: list[int] | None) -> None:
        with self._lock:
            self.busy[slot.index] = max(0, self.busy[slot.index] - 1)
            if tokens is not None:
                self.tokens[slot.index] = tokens


def check_name(name) -> str:
    """A file name inside the slot folder, or a 400."""
    bad = (
        not isinstance(name, str)
        or not name
        or len(name) > MAX_NAME
        or name != name.strip()
        or name.startswith(".")
        or any(c in name for c in "/\\\0")
        or not name.isprintable()
    )
    if bad:
        raise bad_request("filename must be a plain file name (no path, no leading dot)",
                          "filename", "invalid_filename")  # fmt: skip
    return name


def _error(err: PolyError) -> ApiError:
    msg = " ".join(err.message.split())
    if isinstance(err, ModelNotFoundError):
        return ApiError(404, "no such slot file", "not_found_error", "filename", "not_found")
    if isinstance(err, (StateFileError, ContextOverflowError)):
        return ApiError(400, msg, "invalid_request_error", "filename", err.code)
    return ApiError(500, f"slot action failed: {err.code}", "server_error", None, err.code)


def _save(state, table: SlotTable, index: int, name: str) -> dict:
    from poly.serving import persist

    tokens = table.tokens[index]
    if not tokens:
        raise bad_request(f"slot {index} holds no cached tokens", "id_slot", "slot_empty")
    t0 = time.perf_counter()
    with state.scheduler.exclusive() as kv:
        written = persist.save(kv, table.folder / name, tokens)
    ms = (time.perf_counter() - t0) * 1e3
    return {"id_slot": index, "filename": name, "n_saved": len(tokens), "n_written": written,
            "timings": {"save_ms": round(ms, 3)}}  # fmt: skip


def _restore(state, table: SlotTable, index: int, name: str) -> dict:
    from poly.serving import persist

    t0 = time.perf_counter()
    with state.scheduler.exclusive() as kv:
        tokens, read = persist.restore(kv, table.folder / name)
    table.tokens[index] = tokens
    ms = (time.perf_counter() - t0) * 1e3
    return {"id_slot": index, "filename": name, "n_restored": len(tokens), "n_read": read,
            "timings": {"restore_ms": round(ms, 3)}}  # fmt: skip


def _erase(state, table: SlotTable, index: int) -> dict:
    from poly.serving import persist

    tokens, table.tokens[index] = table.tokens[index], None
    with state.scheduler.exclusive() as kv, contextlib.suppress(PolyError):
        persist.drop(kv, tokens or [])  # contiguous caches keep no prefix: nothing to drop
    return {"id_slot": index, "n_erased": len(tokens or ())}


def add_routes(app, state, table: SlotTable) -> None:
    @app.post("/slots/{id_slot}")
    async def slot_action(id_slot: str, request: Request):
        state.check_auth(request)
        action = request.query_params.get("action")
        if not id_slot.isdigit() or int(id_slot) >= table.n:
            raise bad_request(f"no slot {id_slot!r}: slots are 0..{table.n - 1}", "id_slot")
        index = int(id_slot)
        if action == "erase":
            return await run_in_threadpool(_erase, state, table, index)
        if action not in ("save", "restore"):
            raise bad_request("action must be save, restore or erase", "action")
        if table.folder is None:
            raise ApiError(501, "slot save/restore needs lucy serve --slot-save-path DIR",
                           "not_supported_error", None, "not_supported")  # fmt: skip
        body = await state.read_json(request)
        name = check_name(body.get("filename") if isinstance(body, dict) else None)
        if (table.folder / name).is_symlink():
            raise bad_request("filename names a symbolic link", "filename", "invalid_filename")
        run = _save if action == "save" else _restore
        try:
            return await run_in_threadpool(run, state, table, index, name)
        except PolyError as err:
            raise _error(err) from None

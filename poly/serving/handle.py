"""What a caller of the scheduler holds: a request handle with its event queue."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from poly.errors import GenerationError, PolyError
from poly.serving.sequence import TokenLogprob, TokenOut


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestDone:
    usage: Usage
    finish_reasons: tuple[str, ...]  # per choice: "stop", "length" or "cancelled"


@dataclass(frozen=True)
class RequestFailed:
    error: PolyError


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Completion:
    """A finished request, collected from its events."""

    choices: list[Choice]
    usage: Usage


Event = TokenOut | RequestDone | RequestFailed


class RequestHandle:
    """Events of one request: ``TokenOut`` per token, then ``RequestDone`` or ``RequestFailed``.

    Iterate it (blocking), call ``result()`` for the whole completion, or pass ``notify`` to
    ``Scheduler.submit`` to be called with each event on the scheduler thread.
    ``cancel()`` ends the request at the next scheduler step and frees its KV pages.
    """

    def __init__(self, rid: str, prompt: list[int], params, notify: Callable | None = None):
        self.id = rid
        self.prompt = prompt
        self.params = params
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._notify = notify
        self._cancel = threading.Event()
        self.finished = False

    def put(self, event: Event) -> None:
        if isinstance(event, (RequestDone, RequestFailed)):
            self.finished = True
        self._events.put(event)
        if self._notify is not None:
            self._notify(event)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def poll(self) -> list[Event]:
        """The events available now, without blocking."""
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self._events.get()
            yield ev
            if isinstance(ev, (RequestDone, RequestFailed)):
                return

    def result(self, timeout: float | None = None) -> Completion:
        """Block until the request ends; its choices and usage (raises its error)."""
        choices = [Choice(i) for i in range(self.params.n)]
        while True:
            try:
                ev = self._events.get(timeout=timeout)
            except queue.Empty:
                raise GenerationError(f"request {self.id} did not finish in {timeout} s") from None
            if isinstance(ev, RequestFailed):
                raise ev.error
            if isinstance(ev, RequestDone):
                for c, reason in zip(choices, ev.finish_reasons):
                    c.finish_reason = reason
                return Completion(choices, ev.usage)
            c = choices[ev.index]
            c.text += ev.text
            c.token_ids.append(ev.token_id)
            if ev.logprob is not None:
                c.logprobs.append(ev.logprob)

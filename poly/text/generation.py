"""The generation event stream: prefill, then one sampled token per step.

``stream_tokens`` validates everything before touching the model (empty prompt, out-of-vocabulary
ids, context overflow), takes the model's lock without blocking (``ModelBusyError`` if another
stream holds it) and returns a ``TokenStream`` that yields a ``TokenEvent`` per generated token and
a final ``DoneEvent``. Closing the stream early (a consumer that breaks out) releases the lock and
leaves ``model.position`` equal to the tokens actually processed.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from poly.errors import (
    ContextOverflowError,
    GenerationError,
    InvalidTokenError,
    ModelBusyError,
    SamplingParamsError,
)
from poly.text.gendefaults import defaults_of
from poly.text.sampling import GenOptions, Sampler
from poly.text.speculative import Speculation, Speculator
from poly.text.stoptext import StopText  # also imported from here by poly.serving

STOP_REASONS = frozenset({"eos", "max_tokens", "stop_string", "stopped", "context"})


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    text: str  # text completed by this token (may be "": held-back bytes, stop-string prefix, EOS)
    index: int  # 0-based position among the generated tokens


@dataclass(frozen=True)
class DoneEvent:
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int  # tokens in the context before the first generated one
    prefill_tokens: int  # of those, the ones this call ran through the model
    prefill_s: float
    decode_s: float
    prefill_tok_s: float
    decode_tok_s: float
    stop_reason: str
    experts: dict | None = (
        None  # MoE expert residency (poly.runtime.expert_cache report) when paged
    )
    speculative: dict | None = None  # acceptance rate, tokens per pass (Speculator.report)


# --- the per-model lock ---------------------------------------------------------------------------

_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model) -> threading.Lock:
    """The model's own ``_lock`` if it has one, else one created once per model object."""
    lock = getattr(model, "_lock", None)
    if lock is not None:
        return lock
    with _LOCKS_GUARD:
        try:
            return _LOCKS.setdefault(model, threading.Lock())
        except TypeError:  # not weak-referenceable: keep the lock on the object itself
            lock = getattr(model, "_lock", None) or threading.Lock()
            model._lock = lock
            return lock


# --- the stream object ------------------------------------------------------------------------------


@dataclass
class StreamState:
    """What a stream has done so far; readable after an early close."""

    generated: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    done: DoneEvent | None = None
    prefilled: bool = False
    prefill_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class TokenStream(Iterator):
    """An iterator over events that runs ``release`` exactly once: at the end, on error, on
    ``close()`` or when garbage-collected (a bare generator skips its ``finally`` if never started).
    """

    def __init__(self, gen: Iterator, release: Callable[[], None], state: StreamState):
        self._gen = gen
        self._release = release
        self.state = state

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self):
        if self._gen is None:
            raise StopIteration
        try:
            return next(self._gen)
        except BaseException:
            self._finish()
            raise

    def close(self) -> None:
        gen, self._gen = self._gen, None
        try:
            if gen is not None:
                gen.close()
        finally:
            self._finish()

    def _finish(self) -> None:
        self._gen = None
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing sensible to do during garbage collection
            pass


# --- validation -----------------------------------------------------------------------------------


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Integer ids in ``[0, vocab_size)``, at least one; else ``InvalidTokenError``."""
    arr = np.asarray(prompt_ids)
    if arr.size == 0:
        raise InvalidTokenError("empty prompt: at least one token is needed to produce logits")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidTokenError(f"prompt must be a flat list of integer token ids, got {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise InvalidTokenError(
            f"token id {int(arr[i])} at prompt position {i} is outside the vocabulary "
            f"[0, {vocab_size}) ({bad.size} bad ids)"
        )
    return [int(t) for t in arr]


def _plan_context(n_cached: int, prompt: list[int], options: GenOptions, max_seq_len: int, fresh):
    """(prompt, token budget) fitting ``max_seq_len``, or ``ContextOverflowError`` per ``truncate``."""
    want = options.max_tokens
    if options.truncate == "left" and fresh and len(prompt) + want > max_seq_len:
        keep = max_seq_len - want
        if keep >= 1:
            prompt = prompt[len(prompt) - keep :]  # drops the oldest tokens, system prompt included
    room = max_seq_len - n_cached - len(prompt)
    if room >= want:
        return prompt, want
    if options.truncate != "none" and room >= 1:
        return prompt, room
    err = ContextOverflowError(
        f"context overflow: {n_cached} cached + {len(prompt)} prompt + {want} max_tokens "
        f"> max_seq_len {max_seq_len}"
    )
    err.needed, err.max_seq_len = n_cached + len(prompt) + want, max_seq_len
    raise err


def _stop_checker(stop) -> tuple[Callable[[], bool], tuple[str, ...]]:
    """``stop`` may be a callable, an object with ``should_stop()``, or extra stop strings."""
    if stop is None:
        return (lambda: False), ()
    if isinstance(stop, str):
        return (lambda: False), (stop,) if stop else ()
    if callable(getattr(stop, "should_stop", None)):
        return stop.should_stop, ()
    if callable(stop):
        return stop, ()
    if isinstance(stop, Sequence) and all(isinstance(s, str) and s for s in stop):
        return (lambda: False), tuple(stop)
    raise SamplingParamsError("stop must be a callable, an object with should_stop(), or strings")


def _stream_decoder(model):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    from poly.text.tokenizer import StreamDecoder

    return StreamDecoder(tok)


# --- the stream ---------------------------------------------------------------------------------


def stream_tokens(
    model,
    prompt_ids: Sequence[int],
    options: GenOptions | None = None,
    *,
    stop=None,
    start_fresh: bool = True,
    history: Sequence[int] | None = None,
    sampler: Sampler | None = None,
    speculation: Speculation | None = None,
) -> TokenStream:
    """Prefill ``prompt_ids`` and stream generated tokens as events.

    ``start_fresh`` resets the model first. Otherwise the prompt continues the KV cache: at
    ``model.position``, or, with ``history`` (the token ids already cached, used by the
    penalties), after rolling the cache back to ``len(history)``. ``speculation``: propose
    tokens by prompt lookup or a draft model, check them in one pass (poly.text.speculative).
    """
    if options is None:
        options = sampler.options if sampler is not None else None
    if options is None:
        options = defaults_of(model).options  # the model file's settings, else the fallback
    cfg = model.config
    prompt = check_prompt(prompt_ids, cfg.vocab_size)
    history = None if start_fresh or history is None else [int(t) for t in history]
    if history:
        check_prompt(history, cfg.vocab_size)
    if history is not None and len(history) > model.position:
        raise GenerationError(
            f"history has {len(history)} tokens but the KV cache holds only {model.position}"
        )
    n_cached = 0 if start_fresh else (len(history) if history is not None else model.position)
    prompt, budget = _plan_context(n_cached, prompt, options, cfg.max_seq_len, start_fresh)
    should_stop, extra_stops = _stop_checker(stop)
    if sampler is None:
        eos = tuple(getattr(model, "eos_token_ids", ()))
        sampler = Sampler(options, cfg.vocab_size, eos, getattr(model, "tokenizer", None))
    lock = model_lock(model)
    if not lock.acquire(blocking=False):
        raise ModelBusyError("the model is in use by another generation; one stream at a time")
    try:
        spec = None if speculation is None else Speculator(speculation, model, sampler, model_lock)
    except BaseException:
        lock.release()
        raise
    state = StreamState()
    run = _Run(model, prompt, start_fresh, history, n_cached, budget, budget < options.max_tokens)
    gen = run.events(sampler, should_stop, options.stop + extra_stops, state, spec)
    return TokenStream(gen, _releaser(lock, spec), state)


def _releaser(lock, spec: Speculator | None) -> Callable[[], None]:
    if spec is None:
        return lock.release

    def release() -> None:
        try:
            spec.release()
        finally:
            lock.release()

    return release


def _plain_tokens(model, sampler: Sampler, logits, tokens: list[int], n_prompt: int) -> Iterator:
    """One id per forward; the consumer appends each to ``tokens`` before the next."""
    while True:
        yield sampler.sample(logits, tokens, n_prompt)
        logits = model.forward([tokens[-1]])


@dataclass
class _Run:
    model: object
    prompt: list[int]
    start_fresh: bool
    history: list[int] | None
    n_cached: int
    budget: int
    context_limited: bool
    reason: str = "max_tokens"

    def _prefill(self):
        m = self.model
        if self.start_fresh:
            m.reset()
        elif self.history is not None:
            try:
                m.truncate(len(self.history))  # KV rollback to the reused prefix
            except GenerationError:  # a sliding window dropped what the rollback needs
                m.reset()
                return m.forward(self.history + self.prompt)
        return m.forward(self.prompt)

    def events(self, sampler, should_stop, stops, state: StreamState, spec=None) -> Iterator:
        t0 = time.perf_counter()
        logits = self._prefill()
        state.prefilled, state.prefill_tokens = True, len(self.prompt)
        tokens = list(self.history or ()) + self.prompt  # what the penalties look at
        n_prompt = len(tokens)
        if spec is None:
            source = _plain_tokens(self.model, sampler, logits, tokens, n_prompt)
        else:
            spec.start(tokens)
            left = lambda: self.budget - len(state.generated)  # noqa: E731
            source = spec.tokens(logits, tokens, n_prompt, left)
        t1 = time.perf_counter()
        try:
            yield from self._decode(source, sampler, should_stop, stops, state, tokens)
        finally:
            source.close()
            if spec is not None and state.generated:  # the cache holds all but the last token
                self.model.truncate(n_prompt + len(state.generated) - 1)
        t2 = time.perf_counter()
        state.done = self._done(state, t0, t1, t2, spec)
        yield state.done

    def _decode(self, source, sampler, should_stop, stops, state, tokens) -> Iterator:
        eos = set(sampler.eos_tokens)
        decoder, text = _stream_decoder(self.model), StopText(stops)
        reason = "context" if self.context_limited else "max_tokens"
        for i in range(self.budget):
            if should_stop():
                reason = "stopped"
                # held-back text goes into DoneEvent.text (no TokenEvent carries it)
                state.text_parts.append(text.finish(decoder.flush() if decoder else ""))
                break
            tok = next(source)
            tokens.append(tok)
            state.generated.append(tok)
            is_eos = tok in eos
            piece = text.push(decoder.push(tok) if decoder is not None and not is_eos else "")
            final = is_eos or text.hit or i + 1 == self.budget
            if final:
                piece += "" if text.hit else text.finish(decoder.flush() if decoder else "")
                reason = "eos" if is_eos else "stop_string" if text.hit else reason
            state.text_parts.append(piece)
            yield TokenEvent(tok, piece, i)
            if final:
                break
        self.reason = reason

    def _done(self, state: StreamState, t0: float, t1: float, t2: float, spec) -> DoneEvent:
        n_gen = len(state.generated)
        return DoneEvent(
            text=state.text,
            tokens=tuple(state.generated),
            prompt_tokens=self.n_cached + len(self.prompt),
            prefill_tokens=len(self.prompt),
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            prefill_tok_s=len(self.prompt) / (t1 - t0) if t1 > t0 else 0.0,
            decode_tok_s=n_gen / (t2 - t1) if n_gen and t2 > t1 else 0.0,
            stop_reason=self.reason,
            experts=_expert_report(self.model),
            speculative=None if spec is None else spec.report(),
        )


def _expert_report(model) -> dict | None:
    pager = getattr(model, "expert_pager", None)
    return None if pager is None else pager.report()


def generate_text(model, prompt_ids: Sequence[int], options: GenOptions | None = None, **kw):
    """Run ``stream_tokens`` to the end and return its ``DoneEvent``."""
    with stream_tokens(model, prompt_ids, options, **kw) as stream:
        for _event in stream:
            pass
        return stream.state.done

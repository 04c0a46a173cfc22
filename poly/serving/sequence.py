"""One generated sequence (one choice of a request): sampling, penalties, stop strings, logprobs.

The scheduler hands ``Sequence.accept`` the logits of the sequence's last position; it applies
OpenAI's presence/frequency penalties and the optional token mask (structured output), samples
with poly's ``Sampler`` (the same processors as single-sequence generation), and returns a
``TokenOut`` event. ``finish_reason`` becomes "stop" (EOS, a stop string, the grammar ended) or
"length" (max_tokens, the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from poly.text.generation import StopText
from poly.text.sampling import Sampler


# A token mask (structured output, poly.serving.grammar.TokenMask): ``allowed()`` -> bool [V],
# ``consume(token_id)``, and ``finished`` once the grammar accepts only the end.
class Mask(Protocol):
    finished: bool

    def allowed(self) -> np.ndarray: ...

    def consume(self, token_id: int) -> None: ...


# Disallowed tokens get this logit, not -inf: the sampler refuses non-finite logits, and
# exp(-1e30 - max) is exactly 0 in float64, so they are never drawn nor the argmax.
MASKED = np.float32(-1e30)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenOut:
    """One generated token of choice ``index``; ``text`` is what it completes (maybe "")."""

    index: int
    token_id: int
    text: str
    logprob: TokenLogprob | None
    finish_reason: str | None  # set on the sequence's last token


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def token_logprob(logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
    lp = log_softmax(logits)
    top: tuple = ()
    if k > 0:
        idx = np.argpartition(-lp, k - 1)[:k] if k < lp.shape[0] else np.arange(lp.shape[0])
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = tuple((int(i), float(lp[i])) for i in idx)
    return TokenLogprob(int(tok), float(lp[tok]), top)


class Sequence:
    """Choice ``index`` of a request: its tokens, KV state and sampler."""

    def __init__(self, index: int, prompt: list[int], sampler: Sampler, budget: int, params,
                 decoder=None, mask: Mask | None = None, max_len: int = 0):  # fmt: skip
        self.index = index
        self.tokens = list(prompt)  # prompt + generated
        self.n_prompt = len(prompt)
        self.sampler = sampler
        self.budget = budget  # new tokens at most
        self.params = params
        self.decoder = decoder
        self.mask = mask
        self.max_len = max_len
        self.stop = StopText(params.stop)
        self.counts: dict[int, int] = {}  # generated token -> times (presence/frequency)
        self.kv = None  # the scheduler's KV handle (a state list or a paged table)
        self.computed = 0  # tokens whose KV is cached
        self.finish_reason: str | None = None
        self.text_parts: list[str] = []

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt :]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def _penalised(self, logits: np.ndarray) -> np.ndarray:
        p = self.params
        x = logits
        if self.counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self.counts.keys(), dtype=np.int64)
            cnt = np.fromiter(self.counts.values(), dtype=np.float32)
            x = x.copy()
            x[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * cnt
        if self.mask is not None:
            allowed = self.mask.allowed()
            if not allowed.any():  # nothing allowed but the end
                allowed[list(self.sampler.eos_tokens)] = True
            x = np.where(allowed, x, MASKED).astype(np.float32, copy=False)
        return x

    def accept(self, logits: np.ndarray) -> TokenOut:
        """Sample the next token from the logits [V] of the last position."""
        x = self._penalised(logits)
        tok = self.sampler.sample(x, self.tokens, self.n_prompt)
        lp = None
        if self.params.logprobs is not None:
            lp = token_logprob(logits, tok, self.params.logprobs)
        self.tokens.append(tok)
        if self.mask is not None:
            self.mask.consume(tok)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        return self._emit(tok, lp)

    def _emit(self, tok: int, lp: TokenLogprob | None) -> TokenOut:
        is_eos = tok in self.sampler.eos_tokens
        piece = "" if is_eos or self.decoder is None else self.decoder.push(tok)
        piece = self.stop.push(piece)
        n_gen = len(self.tokens) - self.n_prompt
        done = self.mask is not None and getattr(self.mask, "finished", False)
        if is_eos or self.stop.hit or done:
            self.finish_reason = "stop"
        elif n_gen >= self.budget or len(self.tokens) >= self.max_len:
            self.finish_reason = "length"
        if self.finish_reason is not None and not self.stop.hit:
            tail = self.decoder.flush() if self.decoder is not None else ""
            piece += self.stop.push(tail)
            piece += self.stop.flush()
        self.text_parts.append(piece)
        return TokenOut(self.index, tok, piece, lp, self.finish_reason)

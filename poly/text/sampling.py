"""Generation options, logit processors and the seeded sampler.

Processors are small pure functions on a float32 logits vector ``[V]`` and run in Loom's order:
repetition penalty -> DRY -> banned mask (and EOS before ``min_tokens``) -> no-repeat n-gram mask
-> temperature -> top-k -> top-p -> min-p -> softmax -> draw. Their semantics follow HF
transformers' logits processors (DRY: llama.cpp's) so results can be compared one to one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from poly.errors import NumericalError, SamplingParamsError
from poly.text.dry import DEFAULT_BREAKERS, NO_BREAKERS, apply_dry, dry_penalties, sequence_breakers

NEG_INF = np.float32(-np.inf)
TRUNCATE_MODES = ("none", "output", "left")


def is_whole_number(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _ids(name: str, value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(
        value, Sequence | np.ndarray | set | frozenset
    ):
        raise SamplingParamsError(f"{name} must be a sequence of token ids, got {value!r}")
    out = tuple(value)
    for t in out:
        if not is_whole_number(t) or t < 0:
            raise SamplingParamsError(f"{name} must hold non-negative integer token ids, got {t!r}")
    return tuple(int(t) for t in out)


MIN_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS
_F32_MAX = float(np.finfo(np.float32).max)

# (field, check, message): one table instead of an if-chain per field.
_CHECKS: tuple[tuple[str, object, str], ...] = (
    ("max_tokens", lambda v: is_whole_number(v) and v >= 1, "an integer >= 1"),
    ("min_tokens", lambda v: is_whole_number(v) and v >= 0, "an integer >= 0"),
    ("temperature", lambda v: _is_real(v) and math.isfinite(v) and v >= 0, "a finite number >= 0"),
    ("top_k", lambda v: is_whole_number(v) and v >= 0, "an integer >= 0 (0 = off)"),
    ("top_p", lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"),
    ("min_p", lambda v: _is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
    (
        "repetition_penalty",
        lambda v: _is_real(v) and math.isfinite(v) and v > 0,
        "a finite number > 0",
    ),
    ("repetition_window", lambda v: is_whole_number(v) and v >= 0, "an integer >= 0 (0 = all)"),
    ("no_repeat_ngram", lambda v: is_whole_number(v) and v >= 0, "an integer >= 0 (0 = off)"),
    (
        "dry_multiplier",
        lambda v: _is_real(v) and 0 <= v < math.inf,
        "a finite number >= 0 (0 = off)",
    ),
    ("dry_base", lambda v: _is_real(v) and 1 <= v < math.inf, "a finite number >= 1"),
    ("dry_allowed_length", lambda v: is_whole_number(v) and v >= 0, "an integer >= 0"),
    (
        "dry_penalty_last_n",
        lambda v: is_whole_number(v) and v >= -1,
        "an integer >= -1 (-1 = all, 0 = off)",
    ),
    ("seed", lambda v: v is None or (is_whole_number(v) and v >= 0), "None or an integer >= 0"),
    ("deterministic", lambda v: isinstance(v, bool), "a bool"),
    ("penalize_prompt", lambda v: isinstance(v, bool), "a bool"),
    ("truncate", lambda v: v in TRUNCATE_MODES, f"one of {TRUNCATE_MODES}"),
)


@dataclass(frozen=True)
class GenOptions:
    """Validated, immutable generation options. Invalid values raise ``SamplingParamsError``."""

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0
    no_repeat_ngram: int = 0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_BREAKERS
    banned_tokens: tuple[int, ...] = ()
    eos_tokens: tuple[int, ...] | None = None
    seed: int | None = None
    deterministic: bool = False
    stop: tuple[str, ...] = ()
    penalize_prompt: bool = True
    truncate: str = "none"

    def __post_init__(self) -> None:
        if self.truncate is True or self.truncate is False:
            object.__setattr__(self, "truncate", "output" if self.truncate else "none")
        for name, check, what in _CHECKS:
            value = getattr(self, name)
            if not check(value):
                raise SamplingParamsError(f"{name} must be {what}, got {value!r}")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        object.__setattr__(self, "banned_tokens", _ids("banned_tokens", self.banned_tokens))
        if self.eos_tokens is not None:
            object.__setattr__(self, "eos_tokens", _ids("eos_tokens", self.eos_tokens))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        brk = self.dry_sequence_breakers
        brk = (brk,) if isinstance(brk, str) else brk
        if not isinstance(brk, Sequence) or not all(isinstance(s, str) and s for s in brk):
            raise SamplingParamsError(
                f"dry_sequence_breakers must be non-empty strings, got {brk!r}"
            )
        object.__setattr__(self, "dry_sequence_breakers", tuple(brk))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        for name in ("repetition_penalty", "dry_multiplier", "dry_base"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """Temperatures below MIN_TEMPERATURE sample greedily (vLLM's rule: their limit is the
        argmax, and dividing by them leaves float range)."""
        return self.deterministic or self.temperature < MIN_TEMPERATURE

    def replace(self, **changes) -> GenOptions:
        """A copy with ``changes`` applied (validated again); unknown names raise."""
        known = {f.name for f in dataclasses.fields(self) if f.init}
        for name in changes:
            if name not in known:
                raise SamplingParamsError(f"unknown generation option {name!r}")
        return dataclasses.replace(self, **changes)


def repeat_last_n_fields(n) -> dict[str, float | int]:
    """GenOptions fields for llama.cpp's ``repeat_last_n`` (its server field and CLI flag):
    the penalty window, -1 = the whole context (our ``repetition_window`` 0), 0 = no penalty."""
    if not is_whole_number(n) or n < -1:
        raise SamplingParamsError(f"repeat_last_n must be an integer >= -1, got {n!r}")
    if n == 0:
        return {"repetition_penalty": 1.0}
    return {"repetition_window": 0 if n == -1 else int(n)}


# --- processors: pure functions on float32 [V] logits ------------------------------------------


def apply_repetition_penalty(logits: np.ndarray, ids: Sequence[int], penalty: float) -> np.ndarray:
    """CTRL/HF penalty on every id seen: positive logits divided, negative ones multiplied."""
    if penalty == 1.0 or len(ids) == 0:
        return logits
    seen = np.unique(np.asarray(ids, dtype=np.int64))
    seen = seen[seen < logits.shape[0]]
    out = logits.copy()
    vals = out[seen].astype(np.float64)  # a tiny penalty overflows float32 (1/1e-40)
    out[seen] = _finite_f32(np.where(vals < 0, vals * penalty, vals / penalty), out[seen])
    return out


def apply_mask(logits: np.ndarray, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Set the logits of ``ids`` to -inf (banned tokens, EOS before min_tokens, n-gram bans)."""
    if len(ids) == 0:
        return logits
    out = logits.copy()
    out[np.asarray(ids, dtype=np.int64)] = NEG_INF
    return out


def no_repeat_ngram_bans(ids: Sequence[int], n: int) -> np.ndarray:
    """Ids that would complete an n-gram already present in ``ids`` (HF NoRepeatNGram semantics)."""
    if n <= 0 or len(ids) + 1 < n:  # before the array: this runs for every sampled token
        return np.empty(0, dtype=np.int64)
    seq = np.asarray(ids, dtype=np.int64)
    if n == 1:
        return np.unique(seq)
    tail = seq[len(seq) - (n - 1) :]
    windows = sliding_window_view(seq[:-1], n - 1)  # [len-n+1, n-1] prefixes with a follower
    hits = np.flatnonzero((windows == tail).all(axis=1))
    return np.unique(seq[hits + n - 1])


def _finite_f32(scaled: np.ndarray, original: np.ndarray) -> np.ndarray:
    """float64 results back to float32: finite inputs stay finite (clipped to the float32 range,
    so a huge quotient cannot become inf and then NaN in the softmax); masked -inf stays -inf."""
    clipped = np.clip(scaled, -_F32_MAX, _F32_MAX)
    return np.where(np.isfinite(original), clipped, original).astype(np.float32)


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Divide by ``temperature`` in float64 (callers treat T < MIN_TEMPERATURE as greedy)."""
    if temperature == 1.0:
        return logits
    return _finite_f32(logits.astype(np.float64) / temperature, logits)


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (and ties with the k-th), like HF TopKLogitsWarper."""
    vocab = logits.shape[0]
    if k <= 0 or k >= vocab:
        return logits
    kth = np.partition(logits, vocab - k)[vocab - k]  # O(V), no full sort
    return np.where(logits < kth, NEG_INF, logits)


def _softmax64(logits: np.ndarray) -> np.ndarray:
    # float64 on purpose: probabilities for the draw and cumulative sums need the headroom
    x = logits.astype(np.float64)
    x = np.exp(x - x.max())
    return x / x.sum()


def apply_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filter, HF TopPLogitsWarper semantics; sorts only the still-finite candidates."""
    if p >= 1.0:
        return logits
    cand = np.flatnonzero(np.isfinite(logits))
    order = cand[np.argsort(logits[cand], kind="stable")]  # ascending
    cum = np.cumsum(_softmax64(logits[order]))
    remove = cum <= (1.0 - p)
    remove[-1] = False
    out = logits.copy()
    out[order[remove]] = NEG_INF
    return out


def apply_min_p(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below ``min_p`` times the top probability (HF MinP)."""
    if min_p <= 0.0:
        return logits
    probs = _softmax64(logits)
    remove = probs < min_p * probs.max()
    remove[int(np.argmax(probs))] = False
    return np.where(remove, NEG_INF, logits)


def check_finite(logits: np.ndarray, step: int | None = None) -> None:
    # a NaN or Inf anywhere makes x . x NaN/Inf: one BLAS pass without a temporary (2.4 us for
    # 49,152 logits against 15.7 for a float64 sum); a finite |x| past ~1e19 overflows the
    # square and only costs the exact check below
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.dot(logits, logits)):
            return
    if not np.isfinite(logits).all():
        bad = int(np.count_nonzero(~np.isfinite(logits)))
        where = "" if step is None else f" at step {step}"
        raise NumericalError(f"logits contain {bad} NaN/Inf values{where}; refusing to sample")


# --- the sampler -----------------------------------------------------------------------------


class Sampler:
    """Turns logits into token ids with ``options``; owns an explicit seeded PCG64 generator.
    ``tokenizer`` maps DRY's sequence breakers to ids (without one, DRY runs with no breakers)."""

    def __init__(
        self,
        options: GenOptions,
        vocab_size: int,
        eos_tokens: Sequence[int] = (),
        tokenizer=None,
    ):
        if not is_whole_number(vocab_size) or vocab_size < 1:
            raise SamplingParamsError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        self.options = options
        self.vocab_size = int(vocab_size)
        eos = options.eos_tokens if options.eos_tokens is not None else tuple(eos_tokens)
        for name, ids in (("banned_tokens", options.banned_tokens), ("eos_tokens", eos)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingParamsError(
                    f"{name} has ids outside the vocabulary [0, {vocab_size}): {bad}"
                )
        self.eos_tokens = tuple(int(t) for t in eos)
        self.rng = np.random.Generator(np.random.PCG64(options.seed))
        self.breakers = NO_BREAKERS
        if options.dry_multiplier > 0 and tokenizer is not None:
            self.breakers = sequence_breakers(tokenizer, options.dry_sequence_breakers)

    def _context(self, tokens: Sequence[int], n_prompt: int) -> Sequence[int]:
        """Ids the penalties look at: prompt + output (HF), or output only; then the window."""
        ctx = tokens if self.options.penalize_prompt else tokens[n_prompt:]
        w = self.options.repetition_window
        return ctx[len(ctx) - w :] if 0 < w < len(ctx) else ctx

    def _dry(self, ctx: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        o = self.options
        return dry_penalties(ctx, o.dry_multiplier, o.dry_base, o.dry_allowed_length,
                             o.dry_penalty_last_n, self.breakers)  # fmt: skip

    def process(
        self, logits: np.ndarray, tokens: Sequence[int] = (), n_prompt: int = 0
    ) -> np.ndarray:
        """Every processor up to (not including) softmax; ``tokens`` = prompt + generated so far."""
        o = self.options
        logits = np.asarray(logits)
        if logits.shape != (self.vocab_size,):
            raise NumericalError(f"logits shape {logits.shape} != ({self.vocab_size},)")
        check_finite(logits, len(tokens) - n_prompt)
        x = logits.astype(np.float32, copy=False)
        ctx = self._context(tokens, n_prompt)
        x = apply_repetition_penalty(x, ctx, o.repetition_penalty)
        if o.dry_multiplier > 0:
            dry_ctx = tokens if o.penalize_prompt else tokens[n_prompt:]
            x = apply_dry(x, *self._dry(dry_ctx))
        banned = list(o.banned_tokens)
        if len(tokens) - n_prompt < o.min_tokens:
            banned += self.eos_tokens  # suppress EOS until min_tokens (Loom accepts it early)
        x = apply_mask(x, banned)
        ngram_ctx = tokens if o.penalize_prompt else tokens[n_prompt:]
        ngrams = no_repeat_ngram_bans(ngram_ctx, o.no_repeat_ngram)
        x = apply_mask(x, ngrams)
        if (banned or len(ngrams)) and not np.isfinite(x).any():
            raise NumericalError("every token is masked (banned, EOS or n-gram); nothing to sample")
        if o.greedy:
            return x
        x = apply_temperature(x, o.temperature)
        x = apply_top_k(x, o.top_k)
        x = apply_top_p(x, o.top_p)
        return apply_min_p(x, o.min_p)

    def probabilities(
        self, logits: np.ndarray, tokens: Sequence[int] = (), n_prompt: int = 0
    ) -> np.ndarray:
        """The float64 distribution the draw uses (one-hot at the argmax when greedy)."""
        x = self.process(logits, tokens, n_prompt)
        if self.options.greedy:
            p = np.zeros(self.vocab_size)
            p[int(np.argmax(x))] = 1.0
            return p
        return _softmax64(x)

    def sample(self, logits: np.ndarray, tokens: Sequence[int] = (), n_prompt: int = 0) -> int:
        x = self.process(logits, tokens, n_prompt)
        if self.options.greedy:
            return int(np.argmax(x))  # first maximum, like Loom
        cand = np.flatnonzero(np.isfinite(x))
        cum = np.cumsum(_softmax64(x[cand]))
        if not (np.isfinite(cum[-1]) and cum[-1] > 0):
            raise NumericalError("sampling distribution is not finite; refusing to sample")
        i = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
        return int(cand[min(i, len(cand) - 1)])

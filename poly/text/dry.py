"""DRY ("Don't Repeat Yourself"), the repetition penalty of llama.cpp, koboldcpp and
text-generation-webui, with llama.cpp's semantics (``llama_sampler_dry_apply``).

A token that would extend a sequence already seen in the last ``last_n`` ids by more than
``allowed_length`` tokens gets ``multiplier * base ** (length - allowed_length)`` subtracted from
its logit. Sequence breakers (strings such as ``"\\n"``) end a repeat: the match cannot reach back
past the latest one, and a token that is a breaker on its own is never penalised.
``tests/test_dry.py`` compares this module with llama.cpp's sampler on random histories.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# llama.cpp's limits on the breakers (MAX_CHAR_LEN, MAX_SEQ_LEN) and float32's log(max)
MAX_CHAR_LEN = 40
MAX_SEQ_LEN = 20
FLOAT_MAX_LOG = np.float32(88.7228391)
DEFAULT_BREAKERS = ("\n", ":", '"', "*")


@dataclass(frozen=True)
class Breakers:
    """Sequence breakers as token ids: ``tails[head]`` lists the ids that must follow ``head`` to
    complete a breaker (``()`` = the head is a breaker alone)."""

    tails: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    heads: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    alone: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tails: Mapping[int, Sequence[Sequence[int]]]) -> Breakers:
        tails = {int(h): tuple(tuple(int(t) for t in tail) for tail in v) for h, v in tails.items()}
        heads = np.array(sorted(tails), dtype=np.int64)
        return cls(tails, heads, frozenset(h for h, v in tails.items() if () in v))


NO_BREAKERS = Breakers()
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _token_texts(tokenizer) -> list[str]:
    """Each id decoded on its own, special tokens as their text (llama.cpp detokenizes so)."""
    backend = tokenizer.backend
    ids = [[i] for i in range(tokenizer.vocab_size)]
    return backend.decode_batch(ids, skip_special_tokens=False)


def _overlaps(word: str, breaker: str) -> list[int]:
    """Lengths i such that ``word`` ends with ``breaker[:i]`` (a proper prefix starting inside
    the word), as llama.cpp's get_overlapping_token_sequences scans for them."""
    out = []
    pos = word.find(breaker[0])
    while pos != -1:
        i = len(word) - pos
        if i < len(breaker) and word[pos:] == breaker[:i]:
            out.append(i)
        pos = word.find(breaker[0], pos + 1)
    return out


def sequence_breakers(tokenizer, breakers: Sequence[str]) -> Breakers:
    """The breaker map of ``breakers`` for ``tokenizer`` (cached per tokenizer): every token
    containing a breaker is a breaker alone; a token ending in the start of one is a head whose
    tail is the rest of the breaker, tokenized."""
    key = tuple(breakers)
    per_tok = _CACHE.setdefault(tokenizer, {})
    if key in per_tok:
        return per_tok[key]
    found: dict[int, list[tuple[int, ...]]] = {}
    texts = _token_texts(tokenizer)
    for raw in key:
        brk = raw[:MAX_CHAR_LEN]
        for tid, word in enumerate(texts):
            tails = found.setdefault(tid, [])
            if brk in word:
                if () not in tails:
                    tails.append(())
                continue
            for i in _overlaps(word, brk):
                tail = tuple(tokenizer.encode(brk[i:], add_special_tokens=False)[:MAX_SEQ_LEN])
                if tail not in tails:
                    tails.append(tail)
    result = Breakers.of({t: v for t, v in found.items() if v})
    per_tok[key] = result
    return result


def _rep_limit(window: np.ndarray, breakers: Breakers) -> int:
    """How far back a repeat may reach: the tokens after the latest complete breaker."""
    n = len(window)
    for pos in np.flatnonzero(np.isin(window, breakers.heads))[::-1]:
        i = n - 1 - int(pos)  # distance from the end
        longest = -1
        for tail in breakers.tails[int(window[pos])]:
            if longest < len(tail) <= i and tuple(window[pos + 1 : pos + 1 + len(tail)]) == tail:
                longest = len(tail)
        if longest >= 0:
            return i - longest
    return n


def _repeat_counts(window: np.ndarray, limit: int) -> np.ndarray:
    """count[j] = min(limit, length of the longest common suffix of window[:j+1] and window)."""
    n = len(window)
    counts = np.zeros(n - 1, dtype=np.int64)
    active = np.flatnonzero(window[:-1] == window[-1])
    m = 1
    while active.size and m < limit:
        ok = active >= m
        ok[ok] = window[active[ok] - m] == window[n - 1 - m]
        counts[active[~ok]] = m
        active = active[ok]
        m += 1
    counts[active] = min(m, limit)
    return counts


def dry_penalties(
    context: Sequence[int],
    multiplier: float,
    base: float,
    allowed_length: int,
    last_n: int,
    breakers: Breakers,
) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, float32 amounts to subtract from their logits); empty when nothing repeats.
    ``last_n``: ids looked at (-1 = all of ``context``, 0 = off)."""
    none = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))
    if multiplier == 0.0 or base < 1.0 or last_n == 0:
        return none
    window = np.asarray(context[len(context) - last_n :] if 0 < last_n < len(context) else context)
    window = window.astype(np.int64, copy=False)
    if len(window) <= allowed_length:
        return none
    limit = _rep_limit(window, breakers) if breakers.heads.size else len(window)
    if limit < allowed_length:
        return none
    counts = _repeat_counts(window, limit)
    hit = np.flatnonzero(counts >= allowed_length)
    if not hit.size:
        return none
    following, lengths = window[hit + 1], counts[hit]
    order = np.lexsort((lengths, following))  # per token, its longest repeat last
    following, lengths = following[order], lengths[order]
    last = np.r_[following[1:] != following[:-1], True]
    ids, longest = following[last], lengths[last]
    if breakers.alone:
        keep = np.array([int(t) not in breakers.alone for t in ids], dtype=bool)
        ids, longest = ids[keep], longest[keep]
    exp = longest - allowed_length
    base32 = np.float32(base)
    if base32 > np.float32(1.000001):
        exp = np.minimum(exp, int(FLOAT_MAX_LOG / np.float32(math.log(base32))))
    amount = (np.float64(np.float32(multiplier)) * np.float64(base32) ** exp).astype(np.float32)
    return ids, amount


def apply_dry(logits: np.ndarray, ids: np.ndarray, amounts: np.ndarray) -> np.ndarray:
    """Subtract ``amounts`` from the logits of ``ids`` (float32, as llama.cpp does)."""
    if not ids.size:
        return logits
    out = logits.copy()
    inside = ids < out.shape[0]
    out[ids[inside]] -= amounts[inside]
    return out

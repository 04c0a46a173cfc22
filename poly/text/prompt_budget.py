"""Tokenizing a prompt within a token budget, so that a huge prompt costs about what a prompt
that fills the context costs, not its own length (a 4 MB prompt took 5 s whole, holding the
GIL: `tokenizers`' ``encode`` does not release it).

Two checks, cheapest first:

1. Bytes: a token covers at most ``longest_token_bytes`` bytes of the input, so a prompt of
   more than ``budget * longest_token_bytes`` UTF-8 bytes cannot fit and is refused before any
   tokenizing. Only for tokenizers that neither drop nor shrink input (see `_byte_bound_holds`);
   for others this check is skipped, never guessed.
2. Tokens: a longer prompt is tokenized in pieces of ``PIECE_CHARS`` characters, cut before a
   space that follows a non-space (where the common pre-tokenizers split anyway, so the pieces'
   counts add up to the whole's); it is refused as soon as the pieces so far hold more than
   the budget plus ``SLACK_PER_CUT`` per cut. Only a prompt that passes is tokenized whole, for
   its exact ids.
"""

from __future__ import annotations

import json
import threading
import weakref

from poly.errors import ContextOverflowError

PIECE_CHARS = 4096  # short pieces: other threads get the GIL between them
SLACK_PER_CUT = 16  # tokens a cut may add (a prepended space, merges lost in a long word)

_LONGEST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_KEEPS_INPUT_PRE = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}


def _types(node) -> list[dict]:
    """The components of a normalizer/pre-tokenizer entry, Sequences flattened."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        parts = node.get("normalizers") or node.get("pretokenizers") or []
        return [t for p in parts for t in _types(p)]
    return [node]


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _byte_bound_holds(tk) -> bool:
    """True when every input byte reaches a token of the vocabulary: no normalizer that can
    shorten the text (NFC, lowercasing, stripping, a shortening Replace), no pre-tokenizer that
    drops text (BERT's Whitespace, a Split that removes), no fused unknown-token runs."""
    model = tk.model
    if type(model).__name__ != "BPE":
        return False
    if getattr(model, "fuse_unk", True) and not getattr(model, "byte_fallback", False):
        return False
    for n in _types(_state(tk.normalizer)):
        kind = n.get("type")
        if kind == "Replace":
            pattern = (n.get("pattern") or {}).get("String")
            if pattern is None or len(n.get("content", "").encode()) < len(pattern.encode()):
                return False
        elif kind != "Prepend":
            return False
    for p in _types(_state(tk.pre_tokenizer)):
        if p.get("type") not in _KEEPS_INPUT_PRE or p.get("behavior") == "Removed":
            return False
    return True


def longest_token_bytes(tokenizer) -> int | None:
    """Input bytes one token can cover at most (None: no such bound for this tokenizer).
    Byte-level vocabularies spell each byte as one character; others are counted in UTF-8,
    which can only overstate (a `▁` or `<0x41>` stands for one byte). Computed once per
    tokenizer, in a Python loop (0.15 s for 49k tokens) that lets other threads run."""
    with _LOCK:
        if tokenizer not in _LONGEST:
            _LONGEST[tokenizer] = _longest(tokenizer)
        return _LONGEST[tokenizer]


def _longest(tokenizer) -> int | None:
    tk = tokenizer.backend
    if not _byte_bound_holds(tk):
        return None
    byte_level = any(p.get("type") == "ByteLevel" for p in _types(_state(tk.pre_tokenizer)))
    longest = 1
    for i in range(tk.get_vocab_size(with_added_tokens=False)):
        t = tk.id_to_token(i) or ""
        longest = max(longest, len(t) if byte_level else len(t.encode()))
    added = (len(t.content.encode()) for t in tokenizer.added_tokens)
    return max(longest, *added, 4)  # 4: an unknown character becomes one token


def max_prompt_bytes(tokenizer, budget: int) -> int | None:
    """The UTF-8 length past which a prompt cannot fit ``budget`` tokens (None: unbounded)."""
    longest = longest_token_bytes(tokenizer)
    return None if longest is None else max(budget, 0) * longest


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _cut(text: str, start: int) -> int:
    """The end of the piece starting at ``start``: before a space that follows a non-space in
    the piece's second half, else (one long word) at ``PIECE_CHARS``."""
    end = start + PIECE_CHARS
    if end >= len(text):
        return len(text)
    lo = start + PIECE_CHARS // 2
    at = text.rfind(" ", lo, end)
    while at > lo and text[at - 1].isspace():
        at = text.rfind(" ", lo, at - 1)
    return at if at > lo else end


def _overflow(n: int, budget: int, at_least: bool) -> ContextOverflowError:
    has = f"at least {n}" if at_least else f"{n}"
    return ContextOverflowError(f"the prompt has {has} tokens; {budget} fit beside max_tokens")


def encode_within(tokenizer, text: str, budget: int, add_special_tokens: bool = False):
    """The ids of ``text`` (as ``tokenizer.encode``), or ContextOverflowError when it has
    more than ``budget`` tokens, found without tokenizing much more than ``budget`` tokens."""
    limit = max_prompt_bytes(tokenizer, budget)
    size = _utf8_len(text)
    if limit is not None and size > limit:
        longest = limit // max(budget, 1)
        raise ContextOverflowError(
            f"the prompt is {size} bytes; the {budget} tokens that fit beside max_tokens hold "
            f"at most {limit} (this vocabulary's longest token is {longest} bytes)"
        )
    if len(text) > PIECE_CHARS:
        counted, start, cuts = 0, 0, 0
        while start < len(text):
            end = _cut(text, start)
            counted += len(tokenizer.encode(text[start:end]))
            start, cuts = end, cuts + 1
            if counted - SLACK_PER_CUT * cuts > budget:
                raise _overflow(counted - SLACK_PER_CUT * cuts, budget, at_least=True)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > budget:
        raise _overflow(len(ids), budget, at_least=False)
    return ids

"""Tokenization: a thin wrapper over the HF `tokenizers` library, plus an incremental decoder.

We never hand-write BPE (Loom's garbles non-ASCII); `tokenizers` gives exact parity with HF.
Every failure of the Rust side surfaces as `poly.errors.TokenizerError`.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers

from poly.errors import InvalidTokenError, LimitExceededError, TokenizerError
from poly.runtime.heap import trim_heap
from poly.text import tokenizer_cache
from poly.text.regex_guard import nested_quantifier

MAX_TOKENIZER_BYTES = 256 * 1024 * 1024  # real tokenizer.json files are < 20 MB
MAX_VOCAB = 1 << 22
# The checks `_validate_structure` makes; a text kept by `tokenizer_cache` skips them, so a
# change to them bumps this (texts kept under the old checks are checked again).
CHECKS = "structure-1"
REPLACEMENT_CHAR = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")

# A group holding a quantifier, itself quantified: `(a+)+`, `(?:x*)*`, `(a{2,})+` (tokenizers PR#2060).
_NESTED_QUANTIFIER = re.compile(r"\((?:[^()\\]|\\.)*(?:[+*]|\{\d+,\d*\})\)(?:[+*]|\{\d+,\d*\})")


@dataclass(frozen=True)
class AddedToken:
    """One entry of tokenizer.json `added_tokens`."""

    id: int
    content: str
    special: bool


def special_token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or `{"content": ...}`."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"special token must be a string or {{'content': str}}, got {value!r}")


def _iter_regex_patterns(node: Any) -> Iterable[str]:
    # Split pre-tokenizers and Replace normalizers carry {"pattern": {"Regex": "..."}}.
    if isinstance(node, dict):
        pattern = node.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            yield pattern["Regex"]
        for value in node.values():
            yield from _iter_regex_patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _iter_regex_patterns(value)


def _validate_structure(data: Any) -> None:
    """Checks the parts of tokenizer.json the Rust side trusts blindly (sizes, regex shapes)."""
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise TokenizerError("tokenizer.json must be an object with a 'model' object")
    vocab = data["model"].get("vocab")
    if vocab is not None and hasattr(vocab, "__len__") and len(vocab) > MAX_VOCAB:
        raise LimitExceededError(
            f"tokenizer vocabulary has {len(vocab)} entries (limit {MAX_VOCAB})"
        )
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or len(added) > MAX_VOCAB:
        raise TokenizerError("tokenizer.json 'added_tokens' must be a list of bounded length")
    unk = data["model"].get("unk_token")
    known = {t.get("content") for t in added if isinstance(t, dict)}
    if isinstance(unk, str) and isinstance(vocab, dict) and unk not in vocab and unk not in known:
        # tokenizers accepts this and fails later, inside encode (UnkTokenOutOfVocabulary).
        raise TokenizerError(f"unk_token {unk!r} is not in the vocabulary")
    for section in ("normalizer", "pre_tokenizer"):
        for pattern in _iter_regex_patterns(data.get(section)):
            if _NESTED_QUANTIFIER.search(pattern) or nested_quantifier(pattern):
                raise TokenizerError(
                    f"{section} regex {pattern!r} has a nested quantifier (catastrophic backtracking)"
                )


def _panic_error(what: str, exc: BaseException) -> BaseException:
    """A Rust panic inside `tokenizers` (e.g. Oniguruma's retry limit on a backtracking regex)
    becomes a one-line `TokenizerError`; KeyboardInterrupt and SystemExit pass through."""
    if type(exc).__name__ != "PanicException":
        raise exc
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return TokenizerError(f"{what} failed inside the tokenizers library (panic: {first})")


class Tokenizer:
    """A tokenizer.json tokenizer. `bos_token`/`eos_token` come from tokenizer_config.json."""

    def __init__(
        self,
        tk: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ):
        if not isinstance(tk, tokenizers.Tokenizer):
            raise TokenizerError(f"expected a tokenizers.Tokenizer, got {type(tk).__name__}")
        self._tk = tk
        # tokenizers raises "Already borrowed" when one object is used from two threads.
        self._lock = threading.Lock()
        self._added = tuple(
            AddedToken(int(i), t.content, bool(t.special))
            for i, t in sorted(tk.get_added_tokens_decoder().items())
        )
        self._special_ids = frozenset(t.id for t in self._added if t.special)
        self._byte_ids = self._find_byte_fallback_ids(tk)
        self.bos_token = bos_token
        self.eos_token = eos_token

    # --- construction ------------------------------------------------------------------------

    @classmethod
    def from_str(
        cls, json_text: str | bytes | mmap.mmap, *, path: str | None = None, **special: Any
    ) -> Tokenizer:
        """A tokenizer.json's text, or its UTF-8 bytes (any buffer): a kept form of the same text
        (`tokenizer_cache`, named by the bytes' hash) is read without decoding them."""
        if not isinstance(json_text, str | bytes | bytearray | mmap.mmap):
            raise TokenizerError(f"tokenizer.json text must be str, got {type(json_text).__name__}")
        if len(json_text) > MAX_TOKENIZER_BYTES:
            raise LimitExceededError("tokenizer.json is too large", path=path)
        name = tokenizer_cache.key(json_text, f"{CHECKS}|vocab<={MAX_VOCAB}")
        tk = tokenizer_cache.lookup(name)  # this text, checked and kept by an earlier build
        if tk is None:
            tk = cls._checked_build(_utf8(json_text, path), name, path)
        else:
            trim_heap()  # the parse's heap, before a model's weights come in
        return cls(tk, **{k: special_token_content(v) for k, v in special.items()})

    @staticmethod
    def _checked_build(json_text: str, name: str, path: str | None) -> tokenizers.Tokenizer:
        """The structure checks, the Rust build, and the fast form kept (`tokenizer_cache`)."""
        try:
            data = json.loads(json_text)
        except (ValueError, RecursionError) as e:
            raise TokenizerError(f"tokenizer.json is not valid JSON: {e}", path=path) from e
        try:
            _validate_structure(data)
        except TokenizerError as e:
            e.path = path if path is not None else e.path
            raise
        keep = tokenizer_cache.wanted(name)
        form = tokenizer_cache.fast_form(data) if keep else None
        del data  # the parsed tree (~15 MB for a 49k vocabulary) goes before Rust parses again
        try:
            tk = tokenizers.Tokenizer.from_str(json_text)
        except Exception as e:  # the Rust side raises bare Exception
            raise TokenizerError(f"invalid tokenizer.json: {e}", path=path) from e
        except BaseException as e:
            raise _panic_error("loading tokenizer.json", e) from e
        if keep:
            tokenizer_cache.store(name, form, tk.to_str())
        del form
        trim_heap()
        return tk

    @classmethod
    def from_file(cls, path: str | os.PathLike, **special: Any) -> Tokenizer:
        """tokenizer.json read through a mapping: its bytes are hashed in place (a kept form then
        serves) and decoded only to be built, no copy of them left on the heap."""
        path = os.fspath(path)
        try:
            size = os.path.getsize(path)
            if size > MAX_TOKENIZER_BYTES:
                raise LimitExceededError(f"tokenizer.json is {size} bytes", path=path)
            with open(path, "rb") as f:
                text = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot read tokenizer file: {e}", path=path) from e
        try:
            return cls.from_str(text, path=path, **special)
        finally:
            if isinstance(text, mmap.mmap):
                text.close()

    @classmethod
    def from_tokenizers(cls, tk: tokenizers.Tokenizer, **special: Any) -> Tokenizer:
        return cls(tk, **{k: special_token_content(v) for k, v in special.items()})

    @classmethod
    def from_dir(cls, dirpath: str | os.PathLike) -> Tokenizer:
        """tokenizer.json plus bos/eos from tokenizer_config.json when present."""
        dirpath = os.fspath(dirpath)
        tok = cls.from_file(os.path.join(dirpath, "tokenizer.json"))
        cfg_path = os.path.join(dirpath, "tokenizer_config.json")
        if os.path.exists(cfg_path):
            try:
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"bad tokenizer_config.json: {e}", path=cfg_path) from e
            tok.apply_config(cfg)
        return tok

    def apply_config(self, cfg: Mapping[str, Any]) -> None:
        """Takes bos_token/eos_token from a tokenizer_config.json dict (strings or {content})."""
        if not isinstance(cfg, Mapping):
            raise TokenizerError("tokenizer_config must be a JSON object")
        for key in ("bos_token", "eos_token"):
            if key in cfg:
                setattr(self, key, special_token_content(cfg[key]))

    def to_str(self) -> str:
        return self._tk.to_str()

    # --- vocabulary --------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tk

    @property
    def vocab_size(self) -> int:
        """Largest id + 1, counting added tokens (what an embedding table must cover)."""
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def added_tokens(self) -> tuple[AddedToken, ...]:
        return self._added

    @property
    def special_token_ids(self) -> set[int]:
        return set(self._special_ids)

    @property
    def bos_token(self) -> str | None:
        return self._bos

    @bos_token.setter
    def bos_token(self, value: str | None) -> None:
        self._bos = self._check_special("bos_token", value)

    @property
    def eos_token(self) -> str | None:
        return self._eos

    @eos_token.setter
    def eos_token(self, value: str | None) -> None:
        self._eos = self._check_special("eos_token", value)

    @property
    def bos_token_id(self) -> int | None:
        return None if self._bos is None else self.token_to_id(self._bos)

    @property
    def eos_token_id(self) -> int | None:
        return None if self._eos is None else self.token_to_id(self._eos)

    def _check_special(self, name: str, value: Any) -> str | None:
        value = special_token_content(value)
        if value is not None and self._tk.token_to_id(value) is None:
            raise TokenizerError(f"{name} {value!r} is not in the vocabulary")
        return value

    @staticmethod
    def _find_byte_fallback_ids(tk: tokenizers.Tokenizer) -> frozenset[int]:
        if not getattr(tk.model, "byte_fallback", False):
            return frozenset()
        ids = (tk.token_to_id(f"<0x{b:02X}>") for b in range(256))
        return frozenset(i for i in ids if i is not None)

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of the `<0xXX>` pieces when the model uses byte fallback, else empty."""
        return self._byte_ids

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    # --- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() takes str, got {type(text).__name__}")
        # Lone surrogates (surrogateescape terminal input) cannot cross into Rust.
        if not text.isascii():
            text = _SURROGATE.sub(REPLACEMENT_CHAR, text)
        try:
            with self._lock:
                return self._tk.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:
            raise TokenizerError(f"encode failed: {e}") from e
        except BaseException as e:  # a Rust panic (pyo3 PanicException) is a BaseException
            raise _panic_error("encode", e) from e

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = self._check_ids(ids)
        try:
            with self._lock:
                return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)
        except Exception as e:
            raise TokenizerError(f"decode failed: {e}") from e
        except BaseException as e:
            raise _panic_error("decode", e) from e

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        # tokenizers silently drops unknown ids; we refuse them instead.
        out = [int(i) for i in ids]
        limit = self.vocab_size
        for i in out:
            if not 0 <= i < limit:
                raise InvalidTokenError(f"token id {i} is outside [0, {limit})")
        return out

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self._bos!r}, eos={self._eos!r})"


class StreamDecoder:
    """Turns a stream of token ids into text, emitting only completed characters.

    Keeps a small window: the tokens of the last emitted piece (context for decoders that
    treat the first token specially) plus the not-yet-emitted ones. Each push decodes that
    window only, so cost per token is O(1) amortized (Loom re-decodes everything: O(n^2)).
    Text ending in U+FFFD is held back until the byte sequence completes or `flush()`. With byte
    fallback, a run of `<0xXX>` pieces is held until it ends: `decode` replaces a whole run with
    U+FFFDs when any byte in it is invalid, so emitting part of a run early could differ.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._window: list[int] = []
        self._read = 0  # window[:_read] is already emitted

    def push(self, token_id: int) -> str:
        token_id = self._tok._check_ids([token_id])[0]
        if self._skip and self._tok.is_special(token_id):
            return ""  # the full decode never shows these to the decoder either
        self._window.append(token_id)
        if token_id in self._tok.byte_fallback_ids:
            return ""
        text = self._decode(self._window)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        prefix = self._decode(self._window[: self._read])
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Emits whatever is held back (incomplete bytes become U+FFFD, as in `decode`)."""
        if self._read == len(self._window):
            return ""
        text = self._decode(self._window)
        prefix = self._decode(self._window[: self._read])
        self._window = self._window[self._read :]
        self._read = len(self._window)
        return text[len(prefix) :]

    def reset(self) -> None:
        self._window = []
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=self._skip)


def _utf8(text: str | bytes | mmap.mmap, path: str | None) -> str:
    if isinstance(text, str):
        return text
    try:
        return str(text, "utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"tokenizer.json is not UTF-8: {e}", path=path) from e

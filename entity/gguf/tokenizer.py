"""Build a ``tokenizers.Tokenizer`` from a GGUF file's ``tokenizer.ggml.*`` metadata.

Re-implements what transformers' GGUF integration and llama.cpp's vocab loader do:
``gpt2`` = byte-level BPE with the split regex of ``tokenizer.ggml.pre``; ``llama`` =
SentencePiece-style BPE (Metaspace, byte fallback, merges from the file or derived from scores).
Control tokens (token_type 3) become special added tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from entity.gguf.header import T_ARRAY, T_STRING
from entity.gguf.reader import GGUFFile
from poly.errors import TokenizerError, UnsupportedError
from poly.text import tokenizer_cache

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4
MAX_VOCAB = 1 << 22  # reliability.md A5: vocab <= 2^22

# llama.cpp llama-vocab.cpp regexes, by tokenizer.ggml.pre (split then byte-level, no regex).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_REGEX: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx"), _LLAMA3),
    **dict.fromkeys(("smaug-bpe",), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
}
# Pre types that split every digit apart before the GPT-2 regex (llama.cpp's "\p{N}" group;
# SmolLM2's own tokenizer.json has Digits(individual_digits=True) + ByteLevel).
DIGIT_SPLIT = frozenset(
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
)

# Pre types whose split is plain GPT-2 (ByteLevel's own regex); absent means the same (llama.cpp
# "default"). Any other name is a tokenization we would silently get wrong: refused.
GPT2_PRES = frozenset(("default", "gpt-2", "gpt2"))


def _check_pre(pre: str | None, path: str) -> None:
    if pre is None or pre in GPT2_PRES or pre in SPLIT_REGEX or pre in DIGIT_SPLIT:
        return
    known = sorted(GPT2_PRES | SPLIT_REGEX.keys() | DIGIT_SPLIT)
    raise UnsupportedError(
        f"unsupported tokenizer.ggml.pre {pre!r}: its split rule is unknown here "
        f"(supported: {', '.join(known)})",
        path=path,
    )


def _check_spm_spelling(tokens: list[str], path: str) -> None:
    """A vocabulary labelled `llama` (SentencePiece, `▁` for spaces) that is spelled byte-level
    (`Ġ`, no `▁`) is a gpt2 vocabulary mislabelled: it would encode every space wrongly."""
    sample = tokens[: 1 << 16]
    if any("Ġ" in t for t in sample) and not any("▁" in t for t in sample):
        raise TokenizerError(
            "tokenizer.ggml.model is 'llama' (SentencePiece) but the vocabulary is byte-level "
            "BPE (gpt2 spelling: 'Ġ', no '▁')",
            path=path,
        )


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """A built tokenizer plus the special ids and the chat template the file declares."""

    tokenizer: Tokenizer
    model: str
    pre: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    eot_token_id: int | None
    eom_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokenizer.id_to_token(token_id)

    @property
    def end_token_ids(self) -> tuple[int, ...]:
        """eos plus eot/eom when the file names them (ids in file order, no duplicates)."""
        ids = (self.eos_token_id, self.eot_token_id, self.eom_token_id)
        return tuple(dict.fromkeys(i for i in ids if i is not None))


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _string_array(gg: GGUFFile, key: str, required: bool = True) -> list[str] | None:
    return None if _declared(gg, key, required) is None else gg.strings(key)


def _declared(gg: GGUFFile, key: str, required: bool = True):
    """``metadata[key]``, a string array (read or not yet: `GGUFFile.strings`), or None."""
    if key not in gg.metadata:
        if required:
            raise TokenizerError(f"GGUF has no {key}", path=gg.path)
        return None
    if gg.metadata_types[key] != (T_ARRAY, T_STRING):
        raise TokenizerError(f"{key} must be an array of strings", path=gg.path)
    return gg.metadata[key]


def _vocabulary_size(gg: GGUFFile) -> int:
    """How many tokens tokenizer.ggml.tokens lists (its strings not read: `GGUFFile.strings`)."""
    n = len(_declared(gg, "tokenizer.ggml.tokens"))
    if not 0 < n <= MAX_VOCAB:
        raise TokenizerError(f"tokenizer.ggml.tokens has {n} entries", path=gg.path)
    return n


def _numeric_array(gg: GGUFFile, key: str, n: int, kinds: str) -> np.ndarray | None:
    # The element type is checked too, not just the length (llama.cpp#26690: INT8 "scores").
    value = gg.metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype.kind not in kinds or len(value) != n:
        raise TokenizerError(
            f"{key} must be an array of {n} {'floats' if kinds == 'f' else 'integers'}",
            path=gg.path,
        )
    return value


def _token_id(gg: GGUFFile, name: str, n_vocab: int) -> int | None:
    value = gg.metadata.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_vocab:
        raise TokenizerError(
            f"tokenizer.ggml.{name}_token_id {value!r} is not a token id", path=gg.path
        )
    return value


def _merges(gg: GGUFFile, tokens: list[str], scores: np.ndarray | None) -> list[tuple[str, str]]:
    listed = _string_array(gg, "tokenizer.ggml.merges", required=False)
    if listed is not None:
        pairs = _native_pairs(listed)
        if pairs is not None:
            return pairs
        pairs = [tuple(m.split(" ", 1)) for m in listed]  # no extension, or an entry to name
        if any(len(p) != 2 for p in pairs):
            raise TokenizerError(
                "tokenizer.ggml.merges holds an entry without a space", path=gg.path
            )
        return pairs
    if scores is None:
        return []
    return _merges_from_scores(tokens, scores)


def _native_pairs(listed: list[str]) -> list[tuple[str, str]] | None:
    """The C split (csrc/formats/gguf_strings.h merge_pairs) where it is built; None where it is
    not, or an entry has no space (the Python path names it)."""
    from poly.runtime.ckernels import EXT

    split = getattr(EXT, "merge_pairs", None)
    return None if split is None else split(listed)


def _merges_from_scores(tokens: list[str], scores: np.ndarray) -> list[tuple[str, str]]:
    """SentencePiece BPE files have scores, not merges: every split of a token into two vocab
    pieces is a merge ranked by the token's score (transformers' generate_merges)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores.tolist()):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))]
        local = [m for m in local if m[0] in vocab and m[1] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _byte_level(tokens: list[str], merges, pre: str | None) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens outside the byte alphabet (rare mislabels) are re-spelled from their UTF-8 bytes;
    # one set of all the text tells whether any is (not a set per token).
    if set("".join(tokens)) <= alphabet:
        keys = tokens
    else:
        keys = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
                for t in tokens]  # fmt: skip
    vocab = dict(zip(reversed(keys), range(len(keys) - 1, -1, -1)))  # a repeat keeps its first id
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
    regex = SPLIT_REGEX.get(pre or "")
    if regex is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in DIGIT_SPLIT:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(tokens: list[str], merges, unk: str | None, add_space_prefix: bool) -> Tokenizer:
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    model = BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(model)
    scheme = "first" if add_space_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _add_special(tok: Tokenizer, tokens: list[str], types: np.ndarray | None, byte_level: bool):
    if types is None:
        return
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control, user = [], []
    for token, kind in zip(tokens, types.tolist()):
        if kind == TOKEN_CONTROL and (alphabet is None or set(token) <= alphabet):
            control.append(AddedToken(token, normalized=False, special=True))
        elif kind == TOKEN_USER_DEFINED:
            user.append(AddedToken(token, normalized=False, special=False))
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _post_processor(tok: Tokenizer, spec_ids: dict[str, int | None], add_bos: bool, add_eos: bool):
    bos, eos = spec_ids["bos"], spec_ids["eos"]
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return
    bos_t = tok.id_to_token(bos) if add_bos else None
    eos_t = tok.id_to_token(eos) if add_eos else None
    single = " ".join(x for x in (bos_t and f"{bos_t}:0", "$A:0", eos_t and f"{eos_t}:0") if x)
    pair = (
        single
        + " "
        + " ".join(x for x in (bos_t and f"{bos_t}:1", "$B:1", eos_t and f"{eos_t}:1") if x)
    )
    special = [(t, i) for t, i in ((bos_t, bos), (eos_t, eos)) if t is not None]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=special
    )


BUILDERS = {"gpt2": "byte_level", "llama": "sentencepiece"}
# The string arrays a parse may leave unread (`GGUFFile(later=...)`): only a tokenizer that no
# earlier open kept (`tokenizer_cache`) is built from them.
VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


# How `build_tokenizer` builds one; a tokenizer kept by `tokenizer_cache` names it, so a change to
# the building below bumps this (tokenizers kept by the old one are built again).
BUILT = "gguf-1"


def _construct(gg: GGUFFile, model: str, tokens, scores, types, pre, ids) -> Tokenizer:
    merges = _merges(gg, tokens, scores)
    if model == "gpt2":
        tok = _byte_level(tokens, merges, pre)
    else:
        unk = tokens[ids["unknown"]] if ids["unknown"] is not None else None
        space = bool(gg.metadata.get("tokenizer.ggml.add_space_prefix", True))
        tok = _sentencepiece(tokens, merges, unk, space)
    _add_special(tok, tokens, types, byte_level=model == "gpt2")
    return tok


def build_tokenizer(gg: GGUFFile) -> GGUFTokenizerSpec:
    """Build the tokenizer a GGUF file describes. Bad or missing metadata -> ``TokenizerError``."""
    md = gg.metadata
    model = md.get("tokenizer.ggml.model")
    if model not in BUILDERS:
        raise TokenizerError(
            f"unsupported GGUF tokenizer model {model!r} (supported: gpt2, llama)", path=gg.path
        )
    n_vocab = _vocabulary_size(gg)
    scores = _numeric_array(gg, "tokenizer.ggml.scores", n_vocab, "f")
    types = _numeric_array(gg, "tokenizer.ggml.token_type", n_vocab, "iu")
    pre = md.get("tokenizer.ggml.pre")
    pre = pre if isinstance(pre, str) else None
    if model == "gpt2":
        _check_pre(pre, gg.path)
    ids = {k: _token_id(gg, k, n_vocab) for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    name = tokenizer_cache.key(gg.kv_bytes(), f"{BUILT}|vocab<={MAX_VOCAB}")
    # built from these very metadata bytes before: the vocabulary's strings are not read
    tok = tokenizer_cache.lookup(name)
    if tok is None:
        tokens = _string_array(gg, "tokenizer.ggml.tokens")
        if model != "gpt2":
            _check_spm_spelling(tokens, gg.path)
        try:
            tok = _construct(gg, model, tokens, scores, types, pre, ids)
        except TokenizerError:
            raise
        except Exception as exc:  # the tokenizers crate raises plain Exception subclasses
            raise TokenizerError(f"cannot build the GGUF tokenizer: {exc}", path=gg.path) from None
        _post_processor(tok, {"bos": ids["bos"], "eos": ids["eos"]}, add_bos, add_eos)
        if tokenizer_cache.wanted(name):
            built = tok.to_str()
            tokenizer_cache.store(name, tokenizer_cache.fast_form(json.loads(built)), built)
    template = md.get("tokenizer.chat_template")
    return GGUFTokenizerSpec(
        tokenizer=tok,
        model=model,
        pre=pre,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        unk_token_id=ids["unknown"],
        pad_token_id=ids["padding"],
        eot_token_id=ids["eot"],
        eom_token_id=ids["eom"],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=template if isinstance(template, str) else None,
    )


def load_gguf_tokenizer(gg: GGUFFile, fallback_template: str | None = "chatml"):
    """``(poly.text.tokenizer.Tokenizer, poly.text.chat.ChatTemplate | None, GGUFTokenizerSpec)`` for a file.

    Without ``tokenizer.chat_template`` the ``fallback_template`` preset is used (None: no template).
    """
    from poly import timing
    from poly.text.chat import ChatTemplate
    from poly.text.tokenizer import Tokenizer as PolyTokenizer

    with timing.phase("tokenizer"):
        spec = build_tokenizer(gg)
    bos, eos = spec.token(spec.bos_token_id), spec.token(spec.eos_token_id)
    tokenizer = PolyTokenizer(spec.tokenizer, bos_token=bos, eos_token=eos)
    if spec.chat_template is not None:
        template = ChatTemplate(
            spec.chat_template, bos_token=bos, eos_token=eos, name="gguf", lazy=True
        )
    elif fallback_template is not None:
        template = ChatTemplate.preset(fallback_template, lazy=True)
    else:
        template = None
    return tokenizer, template, spec

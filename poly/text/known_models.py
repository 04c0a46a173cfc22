"""Generation settings of the models poly knows, keyed by what the model is, not by its file.

A GGUF carries no generation settings, and neither does a `.entity` converted from one, so the
same weights would decode one way as the demo's `.entity` and another as the user's own GGUF or
``lucy serve model.gguf``. This table closes that gap: a model is identified by its architecture,
its shape and a hash of its vocabulary (the token strings in id order), which every format keeps
(GGUF, HF snapshot, `.entity`, served). Names are not used: GGUF ``general.name`` varies between
converters (the demo's file says "Smollm2 135M 8k Lc100K Mix1 Ep2").

The settings of an entry apply to the fields the model file does not set (`gendefaults`); each
entry says where its numbers were measured.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KNOWN_MODELS", "KnownModel", "by_name", "identify", "vocab_hash"]


@dataclass(frozen=True)
class KnownModel:
    name: str
    architecture: str
    # (num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, vocab_size)
    shape: tuple[int, int, int, int, int, int]
    vocab_sha256: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    measured: str = ""


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        # SmolLM2-135M and -Instruct share shape and vocabulary: both get these settings
        name="SmolLM2-135M-Instruct",
        architecture="llama",
        shape=(30, 576, 1536, 9, 3, 49152),
        vocab_sha256="0e0d60eaa849a6265d6376432d4e79de04a0b21c91918017d99781f9785245d6",
        # greedy, as its generation_config.json means (the factual answers need it), against
        # loops ollama's repeat_penalty 1.1 over the last 64 ids and DRY 0.8 (llama.cpp's base,
        # allowed length and breakers), both on the reply only (on the prompt too, the penalty
        # turned "2+2" into "... lies in the realm of"): no 8-gram 3 times in 256 tokens on 5+5
        # open prompts (greedy alone: 3 and 4 of 5), 20/20 factual answers
        settings={
            "temperature": 0.0,
            "repetition_penalty": 1.1,
            "repetition_window": 64,
            "dry_multiplier": 0.8,
            "penalize_prompt": False,
        },  # fmt: skip
        measured="benchmarks/repetition.py -> benchmarks/results/repetition*.json",
    ),
)


_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def by_name(name: str) -> KnownModel:
    return next(k for k in KNOWN_MODELS if k.name == name)


def vocab_hash(tokenizer: Any) -> str:
    """sha256 of the token strings in id order (special tokens included), NUL-separated; once
    per tokenizer object (every generation resolves its settings through the table)."""
    try:
        return _HASHES[tokenizer]
    except (KeyError, TypeError):
        pass
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    digest = hashlib.sha256("\0".join(tokens).encode("utf-8", "surrogatepass")).hexdigest()
    try:
        _HASHES[tokenizer] = digest
    except TypeError:  # not weak-referenceable: hash again next time
        pass
    return digest


def _shape(config: Any) -> tuple[int, ...]:
    return (config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
            config.num_kv_heads, config.vocab_size)  # fmt: skip


def identify(config: Any, tokenizer: Any) -> KnownModel | None:
    """The table's entry for a model with this config and tokenizer, or None."""
    if getattr(tokenizer, "backend", None) is None or getattr(config, "moe", None) is not None:
        return None
    shape = _shape(config)
    hits = [k for k in KNOWN_MODELS
            if k.shape == shape and k.architecture == config.architecture]  # fmt: skip
    if not hits:  # hashing the vocabulary is not free: only for a model whose shape is in the table
        return None
    digest = vocab_hash(tokenizer)
    return next((k for k in hits if k.vocab_sha256 == digest), None)

"""Generation settings that travel with the model, and the one rule that resolves them.

A model file may carry its own generation settings (HF ``generation_config.json``; the
``generation_config`` header field of a `.entity`): loaders attach them to the model as
``model.generation_defaults``, a `GenerationDefaults` record. A model poly knows has settings of
its own besides (`known_models`: keyed by architecture, shape and vocabulary, so the same for
every file of the model); `defaults_of` adds them to the record.

Every caller (``model.generate``/``stream``, `ChatSession`, ``lucy chat``/``generate``, the menu,
the server) resolves the options it runs with through `resolve`, with one rule per field:

    explicit flag / argument  >  the model file  >  the known model's table entry  >  FALLBACK

The fallback is ``GenOptions()``'s field defaults (temperature 0.7, top_k 40, top_p 1.0,
max_tokens 256; docs/generation.md). `Resolved.origins` names, per field, which of the four
supplied the value, for ``lucy ... --verbose`` and the chat's ``/stats``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from poly.errors import SamplingParamsError

if TYPE_CHECKING:
    from poly.text.sampling import GenOptions

__all__ = [
    "MODEL_FILE",
    "KNOWN_MODEL",
    "FALLBACK",
    "SHOWN",
    "GenerationDefaults",
    "Resolved",
    "defaults_of",
    "resolve",
]

MODEL_FILE = "model file"
KNOWN_MODEL = "known model"
FALLBACK = "fallback"
# The settings --verbose and /stats print, in this order; those after top_p only when they do not
# come from the fallback (off there: a line listing every knob would not fit a terminal).
SHOWN = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "repetition_window",
         "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
         "penalize_prompt", "max_tokens", "seed")  # fmt: skip
_ALWAYS = frozenset({"temperature", "top_k", "top_p", "max_tokens", "seed"})
# Fields a model file may set: per-request ones (seed, stop, eos ids, banned ids) are not its own.
_FILE_FIELDS = frozenset(
    {
        "max_tokens",
        "min_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "repetition_window",
        "no_repeat_ngram",
        "penalize_prompt",
        "dry_multiplier",
        "dry_base",
        "dry_allowed_length",
        "dry_penalty_last_n",
        "dry_sequence_breakers",
    }
)


def _options(**settings: Any) -> GenOptions:
    """`GenOptions` (validated): poly.text.sampling loads at the first use, not at a model's open
    (a file without settings checks none)."""
    from poly.text.sampling import GenOptions

    return GenOptions(**settings)


@functools.cache
def _option_fields() -> frozenset[str]:
    from poly.text.sampling import GenOptions

    return frozenset(f.name for f in dataclasses.fields(GenOptions) if f.init)


def _checked(settings: Mapping[str, Any]) -> dict[str, Any]:
    settings = dict(settings)
    unknown = sorted(set(settings) - _FILE_FIELDS)
    if unknown:
        raise SamplingParamsError(f"not a model generation setting: {', '.join(unknown)}")
    if settings:
        _options(**settings)  # validates every value (SamplingParamsError)
    return settings


@dataclass(frozen=True)
class GenerationDefaults:
    """A model's own generation settings: ``settings``, those its file carries (what a
    conversion stores), and ``known``, the table entry of a known model (``known_name``); both
    GenOptions names, validated. ``source``: where most of them come from."""

    settings: Mapping[str, Any] = field(default_factory=dict)
    source: str = FALLBACK
    known: Mapping[str, Any] = field(default_factory=dict)
    known_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "settings", _checked(self.settings))
        object.__setattr__(self, "known", _checked(self.known))
        if self.known and self.settings:
            _options(**{**self.known, **self.settings})
        if self.source not in (MODEL_FILE, KNOWN_MODEL, FALLBACK):
            raise SamplingParamsError(f"generation defaults source {self.source!r} is unknown")

    @classmethod
    def from_file(cls, settings: Mapping[str, Any] | None) -> GenerationDefaults:
        """The record of a model file's settings: ``"model file"`` if it names any, else the
        fallback. Keys this version does not know, and per-request fields that older writers
        stored (seed, stop, eos_tokens ...), are ignored so every file keeps loading."""
        own = {k: v for k, v in (settings or {}).items() if k in _FILE_FIELDS}
        own = {k: tuple(v) if isinstance(v, list) else v for k, v in own.items()}
        return cls(own, MODEL_FILE if own else FALLBACK)

    def with_known(self, name: str, settings: Mapping[str, Any]) -> GenerationDefaults:
        """This record under the table entry ``name`` of a known model (the file's own win)."""
        source = MODEL_FILE if self.settings else KNOWN_MODEL if settings else FALLBACK
        return GenerationDefaults(self.settings, source, settings, name)

    @property
    def options(self) -> GenOptions:
        """The options a caller with no explicit settings runs with."""
        return _options(**{**self.known, **self.settings})

    def origin(self, name: str) -> str:
        if name in self.settings:
            return MODEL_FILE
        return KNOWN_MODEL if name in self.known else FALLBACK


@dataclass(frozen=True)
class Resolved:
    """The options in use and, per field, where the value came from."""

    options: GenOptions
    origins: Mapping[str, str]

    def shown(self) -> list[tuple[str, Any, str]]:
        """(name, value, origin) of the settings --verbose and /stats print (`SHOWN`)."""
        return [(n, getattr(self.options, n), self.origins[n]) for n in SHOWN
                if n in _ALWAYS or self.origins[n] != FALLBACK]  # fmt: skip

    def replace(self, label: str, **changes: Any) -> Resolved:
        """Apply explicit ``changes`` (validated) labelled ``label`` (e.g. "/set")."""
        options = self.options.replace(**changes)
        return Resolved(options, {**self.origins, **dict.fromkeys(changes, label)})


def defaults_of(model: Any) -> GenerationDefaults:
    """``model.generation_defaults`` (the file's settings; the fallback record for a model
    without one) under the table entry of the model if poly knows it (`known_models.identify`,
    by config and tokenizer: the same for every file of the model, and for one built in memory)."""
    from poly.text.known_models import identify

    found = getattr(model, "generation_defaults", None)
    record = found if isinstance(found, GenerationDefaults) else GenerationDefaults()
    config = getattr(model, "config", None)
    if record.known_name is None and config is not None:
        entry = identify(config, getattr(model, "tokenizer", None))
        if entry is not None:
            return record.with_known(entry.name, entry.settings)
    return record


def resolve(
    model: Any,
    options: GenOptions | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    label: str = "argument",
) -> Resolved:
    """The options to run with: ``overrides`` (explicit, origin ``label``: "argument" in the
    library, "flag" in lucy) over the model file's settings over the fallback.

    A whole ``options`` object is explicit in every field (it replaces the model's defaults);
    ``overrides`` still apply on top of it.
    """
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - _option_fields())
    if unknown:
        raise SamplingParamsError(f"unknown generation option {unknown[0]!r}")
    if options is not None:
        base, origins = options, dict.fromkeys(_option_fields(), label)
    else:
        d = defaults_of(model)
        base, origins = d.options, {n: d.origin(n) for n in _option_fields()}
    resolved = base.replace(**overrides) if overrides else base
    return Resolved(resolved, {**origins, **dict.fromkeys(overrides, label)})

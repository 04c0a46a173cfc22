"""Generation settings as lucy sees them: the flags the user gave, and where each value in use
came from. Defaults are never resolved here: `poly.text.gendefaults.resolve` is the one rule
(flags > the model file's settings > the library fallback)."""

from __future__ import annotations

import dataclasses

# Sampling flags of `lucy chat` / `lucy generate` (argparse dest = GenOptions field).
FLAG_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "dry_multiplier",
               "dry_base", "dry_allowed_length", "dry_penalty_last_n", "seed", "max_tokens")  # fmt: skip

# `/set NAME VALUE` parsers; names are GenOptions fields.
SET_PARSERS = {"temperature": float, "top_k": int, "top_p": float, "max_tokens": int, "seed": int,
               "min_p": float, "repetition_penalty": float, "repetition_window": int,
               "dry_multiplier": float, "dry_base": float, "dry_allowed_length": int,
               "dry_penalty_last_n": int}  # fmt: skip

# --greedy: plain argmax, every logit processor switched off (fields absent from GenOptions skipped).
GREEDY = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "dry_multiplier": 0.0,
    "no_repeat_ngram": 0,
    "banned_tokens": (),
    "min_tokens": 0,
    "deterministic": True,
}

# What the settings line calls each source.
FROM_FLAG, FROM_MODEL, FROM_FALLBACK = "flag", "model file", "fallback"


def flag_name(field: str) -> str:
    """`max_tokens` -> `--max-tokens` (the CLI spelling of a GenOptions field)."""
    return "--" + field.replace("_", "-")


def _known_fields() -> set[str]:
    from poly.text.sampling import GenOptions

    return {f.name for f in dataclasses.fields(GenOptions) if f.init}


def overrides_from_args(args, greedy: bool = False) -> dict:
    """The sampling flags the user actually gave (absent = keep the model's setting)."""
    out = {n: getattr(args, n) for n in FLAG_FIELDS if getattr(args, n, None) is not None}
    if getattr(args, "repeat_last_n", None) is not None:  # llama.cpp's meaning: -1 all, 0 off
        from poly.text.sampling import repeat_last_n_fields

        out = {**out, **repeat_last_n_fields(args.repeat_last_n)}
    if greedy:
        out = {**GREEDY, **{k: v for k, v in out.items() if k != "temperature"}}
    known = _known_fields()
    return {k: v for k, v in out.items() if k in known}


def check_overrides(overrides: dict) -> None:
    """Raise `SamplingParamsError` (naming the flag, not the field) before any slow load."""
    from poly.errors import SamplingParamsError
    from poly.text.sampling import GenOptions

    try:
        GenOptions().replace(**overrides)
    except SamplingParamsError as err:
        text = str(err)
        for name in overrides:
            if text.startswith(name + " "):
                text = flag_name(name) + text[len(name) :]
        raise SamplingParamsError(text) from None


def options_in_use(model, overrides: dict):
    """The `GenOptions` a generation on `model` with these flags runs with (poly's one rule)."""
    return resolved_settings(model, overrides).options


def resolved_settings(model, overrides: dict):
    """`poly.text.gendefaults.resolve` with the flags labelled "flag": the options and, per
    field, "flag", "model file" or "fallback"."""
    from poly.text.gendefaults import resolve

    return resolve(model, None, overrides, label=FROM_FLAG)


def settings_in_use(model, overrides: dict) -> list[tuple[str, object, str]]:
    """(field, value, source) for the sampling settings shown by --verbose and /stats;
    source is "flag", "model file" or "fallback" (poly.text.gendefaults.SHOWN, in order)."""
    return resolved_settings(model, overrides).shown()


def settings_line(rows: list[tuple[str, object, str]]) -> str:
    """One line: `settings: temperature=0.2 (model file) · …`."""
    return "settings: " + " · ".join(f"{n}={v} ({s})" for n, v, s in rows)

"""generation_config.json: the raw file record, its checks, and what poly's sampler takes from it."""

from __future__ import annotations

import dataclasses
from typing import Any

from entity.strict_json import BOOL, FLOAT, INT, TOKEN_IDS, Field, JsonRecord, default
from poly.errors import ConfigError

# transformers' sampling defaults used when do_sample is true and a knob is absent.
HF_SAMPLING_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}

# The generation_config.json fields poly's sampler understands (one table for both records).
SAMPLING_KNOBS: dict[str, Field] = {
    "do_sample": default(BOOL, False),
    "temperature": default(FLOAT),
    "top_k": default(INT),
    "top_p": default(FLOAT),
    "min_p": default(FLOAT),
    "repetition_penalty": default(FLOAT),
    "no_repeat_ngram_size": default(INT),
    "max_new_tokens": default(INT),
}
# The file as read (`entity.strict_json.validate_json`): unknown keys ignored, plus the token
# ids it may name.
RAW_GENERATION: dict[str, Field] = {
    **SAMPLING_KNOBS,
    "bos_token_id": TOKEN_IDS,
    "eos_token_id": TOKEN_IDS,
}


@dataclasses.dataclass(frozen=True)
class HFGeneration:
    """generation_config.json, reduced to what poly's sampler understands: `knobs` holds each
    `SAMPLING_KNOBS` key (None where the file leaves it out). ``present`` is false when the
    snapshot has no such file (the model then runs with poly's documented fallback)."""

    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    present: bool = True

    @classmethod
    def of(cls, raw: JsonRecord, present: bool) -> HFGeneration:
        return cls({k: getattr(raw, k) for k in SAMPLING_KNOBS}, present)

    def gen_options_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``poly.GenOptions`` as transformers reads the file: do_sample
        false (its default) is greedy; {} when there is no file."""
        out: dict[str, Any] = {}
        if not self.present:
            return out
        knobs = self.knobs
        renamed = {"repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
                   "no_repeat_ngram_size": "no_repeat_ngram"}  # fmt: skip
        for key, name in renamed.items():
            if knobs.get(key) is not None:
                out[name] = knobs[key]
        if not knobs.get("do_sample"):
            out["temperature"] = 0.0
            return out
        for key, fallback in HF_SAMPLING_DEFAULTS.items():
            value = knobs.get(key)
            out[key] = fallback if value is None else value
        if knobs.get("min_p") is not None:
            out["min_p"] = knobs["min_p"]
        return out


def check_generation(gen: JsonRecord, source: str | None) -> None:
    # Same rules as the sampling parameters of the CLI (reliability B3 #48).
    checks = {
        "temperature": gen.temperature is None or 0 <= gen.temperature,
        "top_k": gen.top_k is None or gen.top_k >= 0,
        "top_p": gen.top_p is None or 0 < gen.top_p <= 1,
        "min_p": gen.min_p is None or 0 <= gen.min_p < 1,
        "no_repeat_ngram_size": gen.no_repeat_ngram_size is None or gen.no_repeat_ngram_size >= 0,
        "repetition_penalty": gen.repetition_penalty is None or gen.repetition_penalty > 0,
        "max_new_tokens": gen.max_new_tokens is None or gen.max_new_tokens >= 1,
    }
    for key, ok in checks.items():
        if not ok:
            raise ConfigError(f"{key}: invalid value {getattr(gen, key)!r}", path=source)

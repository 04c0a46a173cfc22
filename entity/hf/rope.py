"""config.json's rotary embedding keys: rope_theta and a scaled rope_type with its parameters
(transformers 4.x top-level keys or 5.x rope_parameters), validated into `poly.RopeScaling`."""

from __future__ import annotations

import math
from typing import Any

from entity.families import FAMILIES
from entity.strict_json import BOOL, FLOAT, FLOATS, INT, STR, Field, default, validate_json
from poly.errors import ConfigError, LayerConfigError, UnsupportedError
from poly.rope import ROPE_FIELDS, RopeScaling

SUPPORTED_ROPE_TYPES = ("default", *ROPE_FIELDS)  # "default": no scaling

# A scaled rope_type's keys: `poly.RopeScaling`'s fields (ROPE_FIELDS names the ones each
# type needs).
ROPE_SCALING: dict[str, Field] = {
    "rope_type": STR,
    "factor": FLOAT,
    "low_freq_factor": default(FLOAT),
    "high_freq_factor": default(FLOAT),
    "original_max_position_embeddings": default(INT),
    "attention_factor": default(FLOAT),
    "beta_fast": default(FLOAT),
    "beta_slow": default(FLOAT),
    "mscale": default(FLOAT),
    "mscale_all_dim": default(FLOAT),
    "truncate": default(BOOL, True),
    "short_factor": default(FLOATS),
    "long_factor": default(FLOATS),
}


def parse_rope(
    raw: Any, max_positions: int, source: str | None
) -> tuple[float, RopeScaling | None]:
    """rope_theta and the rope scaling (None: unscaled) of a parsed config.json."""
    # 4.x: top-level rope_theta + optional rope_scaling; 5.x: rope_parameters holds both.
    params = dict(raw.rope_parameters or raw.rope_scaling or {})
    if isinstance(params.get("full_attention"), dict):  # 5.x per layer type (gemma3): global's
        params = dict(params["full_attention"])
    # rope_parameters' own theta wins: a family default merged in as top-level rope_theta must not
    # override it (gemma3's full_attention theta)
    theta = params.pop("rope_theta", None)
    theta = raw.rope_theta if theta is None else theta
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta):
        raise ConfigError(f"rope_theta: must be a finite number, got {theta!r}", path=source)
    if theta <= 0:
        raise ConfigError(f"rope_theta: must be > 0, got {theta}", path=source)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    family = FAMILIES.get(raw.model_type)
    kind = family.rope_aliases.get(kind, kind) if family is not None else kind
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"rope_scaling type {kind!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
            path=source,
        )
    if kind == "default":
        return float(theta), None
    return float(theta), _scaling(raw, kind, params, max_positions, source)


def _scaling(
    raw: Any, kind: str, params: dict, max_positions: int, source: str | None
) -> RopeScaling:
    extra = raw.extra
    if kind == "dynamic":  # transformers' dynamic NTK grows from max_position_embeddings
        params["original_max_position_embeddings"] = max_positions
    # As transformers' standardize_rope_params: a top-level original_max_position_embeddings
    # wins, else the pre-extension length defaults to max_position_embeddings.
    elif "original_max_position_embeddings" in ROPE_FIELDS[kind]:
        top = extra.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = (
            top or params.get("original_max_position_embeddings") or max_positions
        )
        if kind in ("yarn", "longrope") and params.get("factor") is None:  # the extension
            params["factor"] = max_positions / params["original_max_position_embeddings"]
    wanted = {k: params[k] for k in ROPE_SCALING if params.get(k) is not None}
    checked = validate_json(ROPE_SCALING, dict(wanted, rope_type=kind), source)
    missing = [key for key in ROPE_FIELDS[kind] if getattr(checked, key) is None]
    if missing:
        raise ConfigError(f"rope_scaling: {kind} needs {', '.join(missing)}", path=source)
    try:  # RopeScaling's own range checks, named as the file's
        return RopeScaling(**{k: getattr(checked, k) for k in ROPE_SCALING})
    except LayerConfigError as exc:
        raise ConfigError(f"rope_scaling: {exc.message}", path=source) from None

"""config.json's attention keys every family reads alike: the sliding window, the layers it
applies to and a partial rotary factor."""

from __future__ import annotations

from typing import Any

from entity.families import Family
from poly.errors import ConfigError, UnsupportedError


def sliding_window(raw: Any, arch: Family) -> int | None:
    enabled = {"none": False, "sliding_window": True, "use_sliding_window": raw.use_sliding_window}
    return raw.sliding_window if enabled[arch.sliding] else None


# The families whose transformers attention rotates part of each head (partial_rotary_factor);
# llama's and qwen's rotate whole heads whatever the key says.
PARTIAL_ROTARY = frozenset({"phi", "phi3", "gpt_neox", "glm4", "stablelm", "cohere"})
# transformers' default layer_types where not every layer slides (i: layer, m: max_window_layers)
_WINDOW_LAYERS = {
    "qwen2": lambda i, m: i >= m,
    "qwen3": lambda i, m: i >= m,
    "qwen2_moe": lambda i, m: bool((i + 1) % 2) and i < m,
}


def attention_options(raw: Any, arch: Family, source: str | None) -> dict:
    """poly.recipe.AttentionConfig fields every family reads alike: the sliding window and the
    layers it applies to, a partial rotary factor ({}: llama's attention)."""
    extra, out = raw.extra, {}
    window = sliding_window(raw, arch)
    if window is not None:
        if window <= 0:
            raise ConfigError(
                f"sliding_window: must be a positive integer, got {window}", path=source
            )
        out["sliding_window"] = window
        rule, types = _WINDOW_LAYERS.get(raw.model_type), extra.get("layer_types")
        if rule is not None and isinstance(types, list):
            out["window_layers"] = [i for i, t in enumerate(types) if t == "sliding_attention"]
        elif rule is not None:
            most = extra.get("max_window_layers", 28)
            if type(most) is not int:
                raise ConfigError(
                    f"max_window_layers: must be an integer, got {most!r}", path=source
                )
            out["window_layers"] = [i for i in range(raw.num_hidden_layers) if rule(i, most)]
    params = raw.rope_parameters or raw.rope_scaling or {}
    factor = params.get("partial_rotary_factor", extra.get("partial_rotary_factor", 1.0))
    if factor != 1.0 and raw.model_type not in PARTIAL_ROTARY:
        raise UnsupportedError(
            f"partial_rotary_factor {factor} is not supported for model_type {raw.model_type!r}",
            path=source,
        )
    if factor != 1.0:
        out["partial_rotary_factor"] = factor
    return out

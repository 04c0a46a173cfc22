"""The family registry: model_type -> its `Family` record (entity/families/<module>.py).

Adding a family is one file holding its record (`FAMILY`) and one line below.
"""

from __future__ import annotations

import importlib

from entity.families.base import Family, MoENames, TensorName

__all__ = [
    "FAMILIES",
    "GGUF_FAMILIES",
    "REFUSED_REASONS",
    "WRAPPERS",
    "Family",
    "MoENames",
    "TensorName",
]

# One module per family, one line each (order: GGUF names go to the first family listing them).
MODULES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "starcoder2",
    "gemma",
    "gemma2",
    "gemma3_text",
    "smollm3",
    "olmoe",
    "granitemoe",
    "gpt_oss",
    "phi3",
    "gpt_neox",
    "phi",
    "cohere",
    "cohere2",
    "olmo2",
    "granite",
    "glm4",
)

FAMILIES: dict[str, Family] = {}
for _name in MODULES:
    _family: Family = importlib.import_module(f"entity.families.{_name}").FAMILY
    FAMILIES[_family.model_type] = _family

# GGUF `general.architecture` -> the family that reads such files.
GGUF_FAMILIES: dict[str, Family] = {}
for _family in FAMILIES.values():
    if _family.gguf_arch is not None:
        GGUF_FAMILIES.setdefault(_family.gguf_arch, _family)

# A multimodal model_type -> the family of its nested text_config (Gemma 3 4B-27B: "gemma3").
WRAPPERS: dict[str, Family] = {w: f for f in FAMILIES.values() for w in f.wrapper_types}

# Why well-known neighbours are refused (Loom "detected" these and then ran them wrongly).
REFUSED_REASONS: dict[str, str] = {
    "gpt2": "uses fused c_attn, LayerNorm and learned positions",
}

"""Mixture-of-experts rows of the HF tables: config keys -> ``poly.config.MoEConfig`` and the
per-block tensor names of an MoE family (its `MoENames`) -> (part, component, shape).

Components of the ``mlp`` part of a sparse block: ``router`` [E, d], ``shared_gate`` [1, d],
``experts.<e>.<w_gate|w_up|w_down>`` and ``shared.<w_gate|w_up|w_down>`` (SwiGLU views of the
expert sub-layers, see poly.nn.moe).
"""

from __future__ import annotations

from typing import Any

from entity.families import FAMILIES, MoENames
from entity.families.base import QWEN_PROJ
from poly.config import LIMITS, MoEConfig
from poly.errors import ConfigError, LayerConfigError, LimitExceededError


def _names(model_type: str) -> MoENames | None:
    family = FAMILIES.get(model_type)
    return None if family is None else family.moe


def moe_config(raw: Any, num_layers: int, source: str | None) -> MoEConfig | None:
    """The MoEConfig of a parsed config.json (`raw` has the extra keys), None for dense types."""
    names = _names(raw.model_type)
    if names is None:
        return None
    extra = raw.model_extra or {}
    # transformers 5 writes num_local_experts for every family (num_experts is an alias).
    n = extra.get("num_local_experts", extra.get("num_experts"))
    k = extra.get("num_experts_per_tok")
    width = raw.model_dump().get(names.width_key)
    shared = extra.get("shared_expert_intermediate_size", 0) if names.shared else 0
    norm = extra.get("norm_topk_prob", names.norm_topk) if names.norm_topk_key else names.norm_topk
    step = extra.get("decoder_sparse_step", 1)
    only = extra.get("mlp_only_layers") or []
    for key, value in (("num_experts", n), ("num_experts_per_tok", k), ("moe_intermediate_size", width),
                       ("decoder_sparse_step", step)):  # fmt: skip
        if type(value) is not int or value <= 0:
            raise ConfigError(f"{key}: must be a positive int, got {value!r}", path=source)
    if type(shared) is not int or type(norm) is not bool or not isinstance(only, list):
        raise ConfigError("shared_expert_intermediate_size / norm_topk_prob / mlp_only_layers: "
                          "bad type", path=source)  # fmt: skip
    for key, value, name in (("num_experts", n, "num_experts"), ("num_experts_per_tok", k, "top_k"),
                             ("moe_intermediate_size", width, "expert_intermediate_size"),
                             ("shared_expert_intermediate_size", shared, "shared_intermediate_size")):  # fmt: skip
        if value > LIMITS[name]:  # before any per-expert table is built (poly.config.LIMITS)
            raise LimitExceededError(
                f"{key}: {value} exceeds the limit {LIMITS[name]}", path=source
            )
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    try:
        return MoEConfig(n, k, width, "softmax", norm, shared, dense)
    except LayerConfigError as exc:
        raise ConfigError(str(exc), path=source) from None


def block_tensors(
    model_type: str, moe: MoEConfig, hidden: int
) -> dict[str, tuple[str, str, tuple]]:
    """suffix -> (part, component, shape) of one sparse block's FFN tensors."""
    names = _names(model_type)
    prefix, proj = names.prefix, names.proj
    d, width = hidden, moe.expert_intermediate_size
    out: dict[str, tuple[str, str, tuple]] = {
        f"{prefix}gate.weight": ("mlp", "router", (moe.num_experts, d))
    }
    for e in range(moe.num_experts):
        for view, name in proj.items():
            shape = (d, width) if view == "w_down" else (width, d)
            out[f"{prefix}experts.{e}.{name}.weight"] = ("mlp", f"experts.{e}.{view}", shape)
    if moe.shared_intermediate_size:
        ws = moe.shared_intermediate_size
        for view, name in QWEN_PROJ.items():
            shape = (d, ws) if view == "w_down" else (ws, d)
            out[f"{prefix}shared_expert.{name}.weight"] = ("mlp", f"shared.{view}", shape)
        out[f"{prefix}shared_expert_gate.weight"] = ("mlp", "shared_gate", (1, d))
    return out


class MoETargets:
    """The float32 destinations of an MoE layer's components, by component name (the HF
    importer writes ``getattr(targets, component)[...] = tensor``)."""

    def __init__(self, layer):
        from poly.nn import layout, moe

        self._views = dict(moe.views(layer).as_dict())
        for e, expert in enumerate(moe.experts(layer)):
            for name, view in layout.swiglu(expert).as_dict().items():
                self._views[f"experts.{e}.{name}"] = view
        shared = moe.shared_expert(layer)
        if shared is not None:
            for name, view in layout.swiglu(shared).as_dict().items():
                self._views[f"shared.{name}"] = view

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_views"][name]
        except KeyError:
            raise AttributeError(name) from None

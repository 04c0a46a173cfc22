"""Mixture-of-experts rows of the HF tables: config keys -> ``poly.config.MoEConfig`` and the
per-block tensor names of an MoE family (its `MoENames`) -> (part, component, shape).

Components of the ``mlp`` part of a sparse block: ``router`` [E, d], ``shared_gate`` [1, d],
``experts.<e>.<w_gate|w_up|w_down>`` and ``shared.<w_gate|w_up|w_down>`` (SwiGLU views of the
expert sub-layers, see poly.nn.moe).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from entity.families import FAMILIES, MoENames
from entity.families.base import QWEN_PROJ
from poly.config import LIMITS, MoEConfig
from poly.errors import ConfigError, LayerConfigError, LimitExceededError
from poly.quant.ggml import dequantize_mxfp4_hf


def _names(model_type: str) -> MoENames | None:
    family = FAMILIES.get(model_type)
    return None if family is None else family.moe


def moe_config(raw: Any, num_layers: int, source: str | None) -> MoEConfig | None:
    """The MoEConfig of a parsed config.json (`raw` has the extra keys), None for dense types."""
    names = _names(raw.model_type)
    if names is None:
        return None
    extra = raw.extra
    # transformers 5 writes num_local_experts for every family (num_experts is an alias).
    n = extra.get("num_local_experts", extra.get("num_experts"))
    k = extra.get("num_experts_per_tok")
    width = raw.as_dict().get(names.width_key)
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
    opts = dict(names.options)
    if opts.get("activation") == "swiglu_oai":  # GPT-OSS: transformers reads both from config
        opts.update({key: extra[key] for key in ("swiglu_alpha", "swiglu_limit") if key in extra})
    try:
        return MoEConfig(n, k, width, opts.pop("gating", "softmax"), norm, shared, dense, **opts)
    except LayerConfigError as exc:
        raise ConfigError(str(exc), path=source) from None


def expert_storage(raw: Any, source: str | None) -> str | None:
    """ "mxfp4" when config.json's quantization_config says GPT-OSS's experts are stored so."""
    quant = raw.extra.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method != "mxfp4":
        return None
    names = _names(raw.model_type)
    if names is None or names.layout != "gpt_oss":
        raise ConfigError(f"quantization_config mxfp4 is not known for {raw.model_type}",
                          path=source)  # fmt: skip
    return "mxfp4"


def block_tensors(
    model_type: str, moe: MoEConfig, hidden: int, expert_storage: str | None = None
) -> dict[str, tuple[str, str, tuple]]:
    """suffix -> (part, component, shape) of one sparse block's FFN tensors (``expert_storage``
    "mxfp4": GPT-OSS's experts as stored in its released checkpoints)."""
    names = _names(model_type)
    prefix, proj = names.prefix, names.proj
    d, width = hidden, moe.expert_intermediate_size
    router = prefix + names.router
    out: dict[str, tuple[str, str, tuple]] = {router: ("mlp", "router", (moe.num_experts, d))}
    if moe.router_bias:
        out[router.removesuffix("weight") + "bias"] = ("mlp", "router_bias", (moe.num_experts,))
    if names.layout != "per_expert":
        return out | _stacked(names, moe, d, expert_storage)
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
            if expert.weights.master is None:  # paged from the file (entity.hf.paged)
                continue
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


# --- stacked expert tensors (GraniteMoE, GPT-OSS) ------------------------------------------------


def _stacked(names: MoENames, moe: MoEConfig, d: int, quant: str | None) -> dict:
    """suffix -> (part, component, shape) of the experts stored as [E, ...] stacks."""
    n, width, p = moe.num_experts, moe.expert_intermediate_size, names.prefix
    if names.layout == "granite":  # input_linear [E, 2I, d]: the gate rows, then the up rows
        return {f"{p}input_linear.weight": ("mlp", "stack.gate_up", (n, 2 * width, d)),
                f"{p}output_linear.weight": ("mlp", "stack.down", (n, d, width))}  # fmt: skip
    # GPT-OSS: x @ W stacks, gate/up interleaved by column (gate even, up odd); biased
    out = {f"{p}experts.gate_up_proj_bias": ("mlp", "stack.gate_up_bias", (n, 2 * width)),
           f"{p}experts.down_proj_bias": ("mlp", "stack.down_bias", (n, d))}  # fmt: skip
    if quant != "mxfp4":
        out[f"{p}experts.gate_up_proj"] = ("mlp", "stack.gate_up_t", (n, d, 2 * width))
        out[f"{p}experts.down_proj"] = ("mlp", "stack.down_t", (n, width, d))
        return out
    for name, rows, cols in (("gate_up", 2 * width, d), ("down", d, width)):
        if cols % 32:
            raise ConfigError(f"MXFP4 experts need rows of a multiple of 32 values, got {cols}")
        out[f"{p}experts.{name}_proj_blocks"] = (
            "mlp",
            f"mx.{name}.blocks",
            (n, rows, cols // 32, 16),
        )
        out[f"{p}experts.{name}_proj_scales"] = ("mlp", f"mx.{name}.scales", (n, rows, cols // 32))
    return out


def unstack(comps: dict, moe: MoEConfig) -> dict:
    """An MoE block's components with GraniteMoE's / GPT-OSS's stacks (MXFP4 pairs dequantized
    as transformers' integrations/mxfp4.py does) split into per-expert float32
    ``experts.<e>.<view>`` arrays [out, in]; other components pass as they are."""
    stacked = [k for k in comps if k.startswith(("stack.", "mx."))]
    if not stacked:
        return comps
    out = {k: v for k, v in comps.items() if k not in stacked}
    width, views = moe.expert_intermediate_size, {}

    def f32(key: str) -> np.ndarray:
        return np.asarray(comps[key], np.float32)

    if "stack.gate_up" in comps:  # granite: [E, 2I, d], the gate rows then the up rows
        gate_up = f32("stack.gate_up")
        views["w_gate"], views["w_up"] = gate_up[:, :width], gate_up[:, width:]
        views["w_down"] = f32("stack.down")
    if "stack.gate_up_t" in comps:  # GPT-OSS: x @ W [E, d, 2I] -> rows [E, 2I, d]
        gate_up = f32("stack.gate_up_t").transpose(0, 2, 1)
        views["w_down"] = f32("stack.down_t").transpose(0, 2, 1)
    if "mx.gate_up.blocks" in comps:
        gate_up = dequantize_mxfp4_hf(comps["mx.gate_up.blocks"], comps["mx.gate_up.scales"])
        views["w_down"] = dequantize_mxfp4_hf(comps["mx.down.blocks"], comps["mx.down.scales"])
    if "stack.gate_up_bias" in comps:  # GPT-OSS interleaves gate and up: even / odd
        views["w_gate"], views["w_up"] = gate_up[:, 0::2], gate_up[:, 1::2]
        bias = f32("stack.gate_up_bias")
        views["b_gate"], views["b_up"], views["b_down"] = (
            bias[:, 0::2],
            bias[:, 1::2],
            f32("stack.down_bias"),
        )
    for view, stack in views.items():
        for e in range(moe.num_experts):
            out[f"experts.{e}.{view}"] = np.ascontiguousarray(stack[e])
    return out

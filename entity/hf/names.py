"""The HF tensor names of a checkpoint, checked against a config: every tensor maps to a
(block, part, component) slot.

The name table itself is the family's (entity/families/, shared with GGUF); ``part`` names the poly accessor
(``attn_norm``, ``attn``, ``mlp_norm``, ``mlp`` on a block; ``embeddings``, ``final_norm``,
``lm_head`` globally) and ``component`` the layout view. Biases go to the bias slots, never over
weights (Loom's defect). Import is strict: unexpected, missing and mis-shaped tensors are
``WeightMappingError`` naming the tensor; the only tensors dropped on purpose are listed in
``IGNORED_SUFFIXES``. ``cfg`` below is an `entity.hf.config.HFModelConfig`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from entity import arch
from entity.families import FAMILIES, Family
from poly.errors import WeightMappingError

BLOCK_PREFIX = "model.layers.{i}."
_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def block_tensors(family: Family) -> dict[str, tuple[str, str]]:
    """Per-block suffix -> (part, component) of a family."""
    return {t.hf: (t.role, t.component) for t in family.tensors}


def global_tensors(family: Family) -> dict[str, str]:
    """Global name -> part of a family."""
    return {t.hf: t.role for t in family.global_tensors}


# Buffers some older checkpoints saved; recomputed from rope_theta, so dropped explicitly.
IGNORED_SUFFIXES: tuple[str, ...] = ("self_attn.rotary_emb.inv_freq",)

# Which optional components a config switches on (the rest of BLOCK_TENSORS is always present).
OPTIONAL: dict[str, Callable[[Any], bool]] = {
    "b_q": lambda c: c.qkv_bias,
    "b_k": lambda c: c.qkv_bias,
    "b_v": lambda c: c.qkv_bias,
    "b_o": lambda c: c.o_bias,
    "q_norm": lambda c: c.qk_norm,
    "k_norm": lambda c: c.qk_norm,
    "q_norm_bias": lambda c: c.qk_norm and _qk_kind(c) == "layernorm",
    "k_norm_bias": lambda c: c.qk_norm and _qk_kind(c) == "layernorm",
    "lm_head": lambda c: not c.tie_word_embeddings,
    "final_norm_bias": lambda c: c.options.get("block", {}).get("norm") == "layernorm",
    "lm_head_bias": lambda c: c.options.get("lm_head_bias", False),
    "b_gate": lambda c: c.options.get("block", {}).get("mlp_bias", False),
    "b_up": lambda c: c.options.get("block", {}).get("mlp_bias", False),
    "b_down": lambda c: c.options.get("block", {}).get("mlp_bias", False),
}


def _qk_kind(cfg: Any) -> str:
    return (cfg.options.get("attention") or {}).get("qk_norm_kind", "rms")


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes: ``block`` is None for globals (then ``part`` is the global)."""

    block: int | None
    part: str
    component: str
    shape: tuple[int, ...]
    rows: tuple[int, ...] = ()  # a fused "a+b" component: the rows of a, b (split at load)
    groups: int = 1  # the rows repeat per group of this many (per kv head: GPT-NeoX), else 1


def hf_name(block: int | None, part: str, component: str, model_type: str = "llama") -> str:
    """Inverse of the table: the HF name of a slot (used by converters and tests)."""
    family = FAMILIES[model_type]
    if block is None:
        return next(name for name, g in global_tensors(family).items() if g == part)
    suffix = next(s for s, pc in block_tensors(family).items() if pc == (part, component))
    return family.hf_block_prefix.format(i=block) + suffix


def _wanted(cfg: Any, component: str) -> bool:
    rule = OPTIONAL.get(component.split("+")[0])  # a fused "b_q+b_k+b_v": its parts' rule
    return True if rule is None else rule(cfg)


def expected_tensors(cfg: Any) -> dict[str, Slot]:
    """Every tensor the config requires, in block order then globals."""
    from entity.hf.moe import block_tensors as moe_tensors

    tcfg = cfg.to_transformer_config()
    moe = tcfg.moe
    shapes = {role: arch.role_shapes(tcfg, role) for role in arch.roles(tcfg)}  # "mlp": dense
    globals_ = arch.global_shapes(tcfg)
    family = FAMILIES[cfg.model_type]
    per_head = {t.hf for t in family.tensors if t.per_head}
    prefix = family.hf_block_prefix
    out: dict[str, Slot] = {}
    for i in range(cfg.num_layers):
        sparse = moe is not None and i not in moe.dense_layers
        for suffix, (part, comp) in block_tensors(family).items():
            if part in shapes and _wanted(cfg, comp) and not (sparse and part == "mlp"):
                groups = tcfg.num_kv_heads if suffix in per_head else 1
                slot = _slot(i, part, comp, shapes[part], groups)
                shape = arch.stored_shape(tcfg, comp, slot.shape)
                out[prefix.format(i=i) + suffix] = dataclasses.replace(slot, shape=shape)
        if sparse:
            for suffix, (part, comp, shape) in moe_tensors(
                cfg.model_type, moe, cfg.hidden_size, cfg.expert_storage
            ).items():
                out[prefix.format(i=i) + suffix] = Slot(i, part, comp, shape)
    for name, part in global_tensors(family).items():
        if _wanted(cfg, part):
            out[name] = Slot(None, part, "value", globals_[part])
    return out


def _slot(i: int, part: str, comp: str, shapes: dict, groups: int = 1) -> Slot:
    """A block tensor's slot; "w_gate+w_up" (GLM-4's gate_up_proj) stacks its parts' rows, in
    `groups` interleaved runs when the family's table says per_head."""
    if "+" not in comp:
        return Slot(i, part, comp, shapes[comp])
    pieces = [shapes[c] for c in comp.split("+")]
    rows = tuple(p[0] for p in pieces)
    return Slot(i, part, comp, (sum(rows), *pieces[0][1:]), rows, groups)


def _is_ignored(name: str) -> bool:
    m = _BLOCK_RE.match(name)
    return m is not None and m.group(2) in IGNORED_SUFFIXES


def plan(
    cfg: Any, shapes: dict[str, tuple[int, ...]], *, tied_lm_head_ok: bool = True
) -> dict[str, Slot]:
    """Check a checkpoint's tensor names and shapes against the config; return name -> slot.

    ``shapes`` maps every tensor name in the files to its shape. With tied embeddings a stray
    ``lm_head.weight`` is returned too (slot part ``lm_head``) so the caller can check that it
    equals the embeddings; pass ``tied_lm_head_ok=False`` to refuse it outright.
    """
    expected = expected_tensors(cfg)
    lm_head_extra = cfg.tie_word_embeddings and tied_lm_head_ok and "lm_head.weight" in shapes
    if lm_head_extra:
        shape = arch.global_shapes(cfg.to_transformer_config())["lm_head"]
        expected["lm_head.weight"] = Slot(None, "lm_head", "value", shape)
    unexpected = [n for n in shapes if n not in expected and not _is_ignored(n)]
    if unexpected:
        raise WeightMappingError(
            f"unexpected tensor {ascii(unexpected[0])} (no slot in the {cfg.model_type} table)"
            + (f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else "")
        )
    missing = [n for n in expected if n not in shapes]
    if missing:
        raise WeightMappingError(
            f"missing tensor {missing[0]!r}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    for name, slot in expected.items():
        if tuple(shapes[name]) != slot.shape:
            raise WeightMappingError(
                f"tensor {name!r} has shape {tuple(shapes[name])}, expected {slot.shape}"
            )
    return expected


def group_by_block(slots: dict[str, Slot]) -> tuple[dict[int, dict[str, Slot]], dict[str, Slot]]:
    """Split a plan into per-block dicts (block -> name -> slot) and the globals."""
    blocks: dict[int, dict[str, Slot]] = {}
    globals_: dict[str, Slot] = {}
    for name, slot in slots.items():
        if slot.block is None:
            globals_[name] = slot
        else:
            blocks.setdefault(slot.block, {})[name] = slot
    return blocks, globals_

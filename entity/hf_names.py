"""The HF tables: supported architectures (``ARCHITECTURES``) and the tensor-name table that
maps every checkpoint tensor to a (block, part, component) slot.

``part`` names the poly accessor (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp`` on a block;
``embeddings``, ``final_norm``, ``lm_head`` globally) and ``component`` the layout view
(``w_q`` ... ``b_o``, ``q_norm``, ``k_norm``, ``w_gate`` ..., ``gamma``). Biases go to the bias
slots, never over weights (Loom's defect). Import is strict: unexpected, missing and
mis-shaped tensors are ``WeightMappingError`` naming the tensor; the only tensors dropped on
purpose are listed in ``IGNORED_SUFFIXES``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from poly.errors import WeightMappingError

if TYPE_CHECKING:  # hf_config imports this module's architecture table
    from entity.hf_config import HFModelConfig


class ArchSpec(BaseModel):
    """How one HF ``model_type`` maps onto the poly decoder block."""

    model_config = ConfigDict(frozen=True)
    causal_lm_class: str
    # "flag": q/k/v/o biases follow `attention_bias`; "qkv": q/k/v always biased, o never.
    bias_rule: Literal["flag", "qkv", "none"]
    qk_norm: bool
    default_head_dim: int | None  # None: hidden_size // num_attention_heads
    default_max_positions: int
    # Which keys turn a sliding window on (transformers' own rule per architecture).
    sliding: Literal["none", "sliding_window", "use_sliding_window"]


# Defaults mirror transformers' config classes so a sparse config.json means the same here.
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(
        causal_lm_class="LlamaForCausalLM",
        bias_rule="flag",
        qk_norm=False,
        default_head_dim=None,
        default_max_positions=2048,
        sliding="none",
    ),
    "mistral": ArchSpec(
        causal_lm_class="MistralForCausalLM",
        bias_rule="none",
        qk_norm=False,
        default_head_dim=None,
        default_max_positions=131072,
        sliding="sliding_window",
    ),
    "qwen2": ArchSpec(
        causal_lm_class="Qwen2ForCausalLM",
        bias_rule="qkv",
        qk_norm=False,
        default_head_dim=None,
        default_max_positions=32768,
        sliding="use_sliding_window",
    ),
    "qwen3": ArchSpec(
        causal_lm_class="Qwen3ForCausalLM",
        bias_rule="flag",
        qk_norm=True,
        default_head_dim=128,
        default_max_positions=32768,
        sliding="use_sliding_window",
    ),
}

# Why well-known neighbours are refused (Loom "detected" these and then ran them wrongly).
REFUSED_REASONS: dict[str, str] = {
    "gemma": "needs (1+w) RMSNorm, sqrt(hidden) embedding scale and GeGLU",
    "gemma2": "needs logit soft-capping, sandwich norms and GeGLU",
    "gemma3": "needs sandwich norms, local/global attention and GeGLU",
    "phi": "uses LayerNorm, partial rotary and a parallel block",
    "phi3": "stores fused qkv_proj / gate_up_proj and may use longrope",
    "gpt2": "uses fused c_attn, LayerNorm and learned positions",
    "mixtral": "mixture of experts (not in the dense importer)",
    "qwen2_moe": "mixture of experts (not in the dense importer)",
    "qwen3_moe": "mixture of experts (not in the dense importer)",
}


BLOCK_PREFIX = "model.layers.{i}."
_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Per-block suffix -> (part, component).
BLOCK_TENSORS: dict[str, tuple[str, str]] = {
    "input_layernorm.weight": ("attn_norm", "gamma"),
    "self_attn.q_proj.weight": ("attn", "w_q"),
    "self_attn.k_proj.weight": ("attn", "w_k"),
    "self_attn.v_proj.weight": ("attn", "w_v"),
    "self_attn.o_proj.weight": ("attn", "w_o"),
    "self_attn.q_proj.bias": ("attn", "b_q"),
    "self_attn.k_proj.bias": ("attn", "b_k"),
    "self_attn.v_proj.bias": ("attn", "b_v"),
    "self_attn.o_proj.bias": ("attn", "b_o"),
    "self_attn.q_norm.weight": ("attn", "q_norm"),
    "self_attn.k_norm.weight": ("attn", "k_norm"),
    "post_attention_layernorm.weight": ("mlp_norm", "gamma"),
    "mlp.gate_proj.weight": ("mlp", "w_gate"),
    "mlp.up_proj.weight": ("mlp", "w_up"),
    "mlp.down_proj.weight": ("mlp", "w_down"),
}
GLOBAL_TENSORS: dict[str, str] = {
    "model.embed_tokens.weight": "embeddings",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
# Buffers some older checkpoints saved; recomputed from rope_theta, so dropped explicitly.
IGNORED_SUFFIXES: tuple[str, ...] = ("self_attn.rotary_emb.inv_freq",)

# Shape of each component as a function of the config (matrices are [out, in], like nn.Linear).
SHAPES: dict[str, Callable[[HFModelConfig], tuple[int, ...]]] = {
    "w_q": lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    "w_k": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "w_v": lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    "w_o": lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    "b_q": lambda c: (c.num_heads * c.head_dim,),
    "b_k": lambda c: (c.num_kv_heads * c.head_dim,),
    "b_v": lambda c: (c.num_kv_heads * c.head_dim,),
    "b_o": lambda c: (c.hidden_size,),
    "q_norm": lambda c: (c.head_dim,),
    "k_norm": lambda c: (c.head_dim,),
    "gamma": lambda c: (c.hidden_size,),
    "w_gate": lambda c: (c.intermediate_size, c.hidden_size),
    "w_up": lambda c: (c.intermediate_size, c.hidden_size),
    "w_down": lambda c: (c.hidden_size, c.intermediate_size),
    "embeddings": lambda c: (c.vocab_size, c.hidden_size),
    "final_norm": lambda c: (c.hidden_size,),
    "lm_head": lambda c: (c.vocab_size, c.hidden_size),
}

# Which optional components a config switches on (the rest of BLOCK_TENSORS is always present).
OPTIONAL: dict[str, Callable[[HFModelConfig], bool]] = {
    "b_q": lambda c: c.qkv_bias,
    "b_k": lambda c: c.qkv_bias,
    "b_v": lambda c: c.qkv_bias,
    "b_o": lambda c: c.o_bias,
    "q_norm": lambda c: c.qk_norm,
    "k_norm": lambda c: c.qk_norm,
    "lm_head": lambda c: not c.tie_word_embeddings,
}


@dataclass(frozen=True)
class Slot:
    """Where one HF tensor goes: ``block`` is None for globals (then ``part`` is the global)."""

    block: int | None
    part: str
    component: str
    shape: tuple[int, ...]


def hf_name(block: int | None, part: str, component: str) -> str:
    """Inverse of the table: the HF name of a slot (used by converters and tests)."""
    if block is None:
        return next(name for name, g in GLOBAL_TENSORS.items() if g == part)
    suffix = next(s for s, pc in BLOCK_TENSORS.items() if pc == (part, component))
    return BLOCK_PREFIX.format(i=block) + suffix


def _wanted(cfg: HFModelConfig, component: str) -> bool:
    rule = OPTIONAL.get(component)
    return True if rule is None else rule(cfg)


def expected_tensors(cfg: HFModelConfig) -> dict[str, Slot]:
    """Every tensor the config requires, in block order then globals."""
    out: dict[str, Slot] = {}
    for i in range(cfg.num_layers):
        for suffix, (part, comp) in BLOCK_TENSORS.items():
            if _wanted(cfg, comp):
                out[BLOCK_PREFIX.format(i=i) + suffix] = Slot(i, part, comp, SHAPES[comp](cfg))
    for name, part in GLOBAL_TENSORS.items():
        if _wanted(cfg, part):
            out[name] = Slot(None, part, "value", SHAPES[part](cfg))
    return out


def _is_ignored(name: str) -> bool:
    m = _BLOCK_RE.match(name)
    return m is not None and m.group(2) in IGNORED_SUFFIXES


def plan(
    cfg: HFModelConfig, shapes: dict[str, tuple[int, ...]], *, tied_lm_head_ok: bool = True
) -> dict[str, Slot]:
    """Check a checkpoint's tensor names and shapes against the config; return name -> slot.

    ``shapes`` maps every tensor name in the files to its shape. With tied embeddings a stray
    ``lm_head.weight`` is returned too (slot part ``lm_head``) so the caller can check that it
    equals the embeddings; pass ``tied_lm_head_ok=False`` to refuse it outright.
    """
    expected = expected_tensors(cfg)
    lm_head_extra = cfg.tie_word_embeddings and tied_lm_head_ok and "lm_head.weight" in shapes
    if lm_head_extra:
        expected["lm_head.weight"] = Slot(None, "lm_head", "value", SHAPES["lm_head"](cfg))
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

"""Roles and shapes of the poly decoder block (the model families: entity/families/, one file
each; a `.entity` open never imports them).

A llama decoder block has four roles, the poly accessors ``attn_norm``, ``attn``, ``mlp_norm`` and
``mlp`` (``Transformer.attn(i)`` ...); components are the layer's named master views (``w_q`` ...
``b_o``, ``q_norm``, ``k_norm``, ``w_gate`` ... ``b_down``, ``gamma``). Globals are ``embeddings``,
``final_norm`` and ``lm_head``. Shapes are never restated here: `role_shapes` asks poly's layer
spec (the single place entity reads them), `global_shapes` the config.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from poly.config import TransformerConfig

__all__ = [
    "ROLES",
    "NORM_ROLES",
    "role_shapes",
    "global_shapes",
    "roles",
]


ROLES = ("attn_norm", "attn", "mlp_norm", "mlp")  # llama's block (Loom v1's 4-layer stride)
NORM_ROLES = frozenset({"attn_norm", "mlp_norm", "attn_post_norm", "mlp_post_norm"})


def roles(cfg: TransformerConfig) -> tuple[str, ...]:
    """The weight roles of every block of `cfg`, in block order (its recipe's)."""
    from poly.model.block import weight_roles

    return weight_roles(cfg.block)


@functools.lru_cache(maxsize=64)
def role_shapes(cfg: TransformerConfig, role: str) -> dict[str, tuple[int, ...]]:
    """Component -> shape of one block role, in master order, from poly's layer spec.

    The one place entity learns weight shapes (HF and GGUF name checks, `.entity` blobs, Loom v1
    masters all call it). Matrices are [out, in] like ``nn.Linear``.
    """
    from poly.model.block import param_shapes

    # "mlp" is the dense SwiGLU (of an MoE model's dense layers): the sparse FFN's names and
    # shapes are entity.hf.moe's, entity.gguf.moe's and entity.dotentity.moe's.
    return param_shapes(dataclasses.replace(cfg, moe=None))[role]


def stored_shape(cfg: TransformerConfig, comp: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A component's shape as HF and GGUF files store it: per-head q/k norm weights (cohere)
    are [heads, head_dim] there, one flat row in poly."""
    heads = cfg.attention is not None and cfg.attention.qk_norm_heads
    if heads and comp in ("q_norm", "k_norm"):
        return (shape[0] // cfg.head_dim, cfg.head_dim)
    return shape


def global_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the global tensors (the embedding table and LM head are [vocab, hidden])."""
    table = (cfg.vocab_size, cfg.hidden_size)
    out = {"embeddings": table, "final_norm": (cfg.hidden_size,), "lm_head": table}
    if cfg.block.norm == "layernorm":  # a LayerNorm with a bias: the final one has it too
        out["final_norm_bias"] = (cfg.hidden_size,)
    if cfg.lm_head_bias:  # Phi-2
        out["lm_head_bias"] = (cfg.vocab_size,)
    return out

"""The one architecture table: which model families entity imports, and how every tensor name of
an HF checkpoint or a GGUF file maps onto a poly decoder-block role and component.

A decoder block has four roles, the poly accessors ``attn_norm``, ``attn``, ``mlp_norm`` and
``mlp`` (``Transformer.attn(i)`` ...); components are the layer's named master views (``w_q`` ...
``b_o``, ``q_norm``, ``k_norm``, ``w_gate`` ... ``b_down``, ``gamma``). Globals are ``embeddings``,
``final_norm`` and ``lm_head``. Shapes are never restated here: `role_shapes` asks poly's layer
spec (the single place entity reads them), `global_shapes` the config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from poly.config import TransformerConfig

__all__ = [
    "ArchSpec",
    "ARCHITECTURES",
    "GGUF_ARCHITECTURES",
    "REFUSED_REASONS",
    "ROLES",
    "NORM_ROLES",
    "TensorName",
    "BLOCK_TENSORS",
    "GLOBAL_TENSORS",
    "role_shapes",
    "global_shapes",
]


class ArchSpec(BaseModel):
    """How one model family maps onto the poly decoder block (HF and GGUF rules together)."""

    model_config = ConfigDict(frozen=True)
    causal_lm_class: str  # HF config.json "architectures"
    # "flag": q/k/v/o biases follow `attention_bias`; "qkv": q/k/v always biased, o never.
    bias_rule: Literal["flag", "qkv", "none"]
    qk_norm: bool
    default_head_dim: int | None  # None: hidden_size // num_attention_heads
    default_max_positions: int
    # Which keys turn a sliding window on (transformers' own rule per architecture).
    sliding: Literal["none", "sliding_window", "use_sliding_window"]
    # GGUF: llama.cpp's convert_hf_to_gguf permutes q/k rows for LlamaModel only.
    permute_qk: bool = False


# Defaults mirror transformers' config classes so a sparse config.json means the same here.
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(causal_lm_class="LlamaForCausalLM", bias_rule="flag", qk_norm=False,
                      default_head_dim=None, default_max_positions=2048, sliding="none",
                      permute_qk=True),
    "mistral": ArchSpec(causal_lm_class="MistralForCausalLM", bias_rule="none", qk_norm=False,
                        default_head_dim=None, default_max_positions=131072,
                        sliding="sliding_window", permute_qk=True),
    "qwen2": ArchSpec(causal_lm_class="Qwen2ForCausalLM", bias_rule="qkv", qk_norm=False,
                      default_head_dim=None, default_max_positions=32768,
                      sliding="use_sliding_window"),
    "qwen3": ArchSpec(causal_lm_class="Qwen3ForCausalLM", bias_rule="flag", qk_norm=True,
                      default_head_dim=128, default_max_positions=32768,
                      sliding="use_sliding_window"),
    # Mixture of experts: the FFN tensor names and config keys are entity.hf.moe's and
    # entity.gguf.moe's (per-expert names); the rest of the block is the table below.
    "mixtral": ArchSpec(causal_lm_class="MixtralForCausalLM", bias_rule="none", qk_norm=False,
                        default_head_dim=None, default_max_positions=131072,
                        sliding="sliding_window", permute_qk=True),
    "qwen2_moe": ArchSpec(causal_lm_class="Qwen2MoeForCausalLM", bias_rule="qkv", qk_norm=False,
                          default_head_dim=None, default_max_positions=32768,
                          sliding="use_sliding_window"),
    "qwen3_moe": ArchSpec(causal_lm_class="Qwen3MoeForCausalLM", bias_rule="flag", qk_norm=True,
                          default_head_dim=None, default_max_positions=32768,
                          sliding="use_sliding_window"),
}  # fmt: skip
# GGUF `general.architecture` -> the family (Mistral, SmolLM and Mixtral files say "llama").
GGUF_ARCHITECTURES: dict[str, ArchSpec] = {k: ARCHITECTURES[k] for k in ("llama", "qwen2", "qwen3")}
GGUF_ARCHITECTURES.update(qwen2moe=ARCHITECTURES["qwen2_moe"], qwen3moe=ARCHITECTURES["qwen3_moe"])

# Why well-known neighbours are refused (Loom "detected" these and then ran them wrongly).
REFUSED_REASONS: dict[str, str] = {
    "gemma": "needs (1+w) RMSNorm, sqrt(hidden) embedding scale and GeGLU",
    "gemma2": "needs logit soft-capping, sandwich norms and GeGLU",
    "gemma3": "needs sandwich norms, local/global attention and GeGLU",
    "phi": "uses LayerNorm, partial rotary and a parallel block",
    "phi3": "stores fused qkv_proj / gate_up_proj and may use longrope",
    "gpt2": "uses fused c_attn, LayerNorm and learned positions",
    "olmoe": "needs q/k RMSNorm over all heads at once (not per head)",
}

ROLES = ("attn_norm", "attn", "mlp_norm", "mlp")
NORM_ROLES = frozenset({"attn_norm", "mlp_norm"})


@dataclass(frozen=True)
class TensorName:
    """One tensor: its role and component, its HF name (a suffix of ``model.layers.{i}.`` for
    block tensors) and its GGUF name (a suffix of ``blk.{i}.``). Globals: component "value"."""

    role: str
    component: str
    hf: str
    gguf: str


BLOCK_TENSORS: tuple[TensorName, ...] = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn", "w_q", "self_attn.q_proj.weight", "attn_q.weight"),
    TensorName("attn", "w_k", "self_attn.k_proj.weight", "attn_k.weight"),
    TensorName("attn", "w_v", "self_attn.v_proj.weight", "attn_v.weight"),
    TensorName("attn", "w_o", "self_attn.o_proj.weight", "attn_output.weight"),
    TensorName("attn", "b_q", "self_attn.q_proj.bias", "attn_q.bias"),
    TensorName("attn", "b_k", "self_attn.k_proj.bias", "attn_k.bias"),
    TensorName("attn", "b_v", "self_attn.v_proj.bias", "attn_v.bias"),
    TensorName("attn", "b_o", "self_attn.o_proj.bias", "attn_output.bias"),
    TensorName("attn", "q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight"),
    TensorName("attn", "k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight"),
    TensorName("mlp_norm", "gamma", "post_attention_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp", "w_gate", "mlp.gate_proj.weight", "ffn_gate.weight"),
    TensorName("mlp", "w_up", "mlp.up_proj.weight", "ffn_up.weight"),
    TensorName("mlp", "w_down", "mlp.down_proj.weight", "ffn_down.weight"),
)
GLOBAL_TENSORS: tuple[TensorName, ...] = (
    TensorName("embeddings", "value", "model.embed_tokens.weight", "token_embd.weight"),
    TensorName("final_norm", "value", "model.norm.weight", "output_norm.weight"),
    TensorName("lm_head", "value", "lm_head.weight", "output.weight"),
)


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


def global_shapes(cfg: TransformerConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the global tensors (the embedding table and LM head are [vocab, hidden])."""
    table = (cfg.vocab_size, cfg.hidden_size)
    return {"embeddings": table, "final_norm": (cfg.hidden_size,), "lm_head": table}

"""gpt_neox (Pythia, GPT-NeoX-20B, RedPajama-INCITE ...): LayerNorm with a bias, a plain biased
GELU MLP, q/k/v fused in `query_key_value` with the rows interleaved per head ([q_h; k_h; v_h]
for each head h), split at load, RoPE over the first `rotary_pct` of each head (NeoX halves),
and the parallel residual x + attn(ln1(x)) + mlp(ln2(x)) when `use_parallel_residual` (two
LayerNorms), else the sequential pre-norm block. mlx-lm: models/gpt_neox.py."""

import dataclasses

from entity.families.base import Family, TensorName
from entity.families.starcoder2 import FFN
from poly.errors import LayerConfigError
from poly.recipe import BlockRecipe

BLOCK = BlockRecipe(norm="layernorm", ffn="gelu_mlp", mlp_bias=True, parallel=True)

TENSORS: tuple[TensorName, ...] = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn_norm", "beta", "input_layernorm.bias", "attn_norm.bias"),
    TensorName("attn", "w_q+w_k+w_v", "attention.query_key_value.weight", "attn_qkv.weight",
               per_head=True),
    TensorName("attn", "b_q+b_k+b_v", "attention.query_key_value.bias", "attn_qkv.bias",
               per_head=True),
    TensorName("attn", "w_o", "attention.dense.weight", "attn_output.weight"),
    TensorName("attn", "b_o", "attention.dense.bias", "attn_output.bias"),
    TensorName("mlp_norm", "gamma", "post_attention_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp_norm", "beta", "post_attention_layernorm.bias", "ffn_norm.bias"),
    TensorName("mlp", "w_up", "mlp.dense_h_to_4h.weight", "ffn_up.weight"),
    TensorName("mlp", "b_up", "mlp.dense_h_to_4h.bias", "ffn_up.bias"),
    TensorName("mlp", "w_down", "mlp.dense_4h_to_h.weight", "ffn_down.weight"),
    TensorName("mlp", "b_down", "mlp.dense_4h_to_h.bias", "ffn_down.bias"),
)  # fmt: skip
GLOBALS: tuple[TensorName, ...] = (
    TensorName("embeddings", "value", "gpt_neox.embed_in.weight", "token_embd.weight"),
    TensorName("final_norm", "value", "gpt_neox.final_layer_norm.weight", "output_norm.weight"),
    TensorName("final_norm_bias", "value", "gpt_neox.final_layer_norm.bias", "output_norm.bias"),
    TensorName("lm_head", "value", "embed_out.weight", "output.weight"),
)
# Buffers older checkpoints saved (the causal mask, rotary frequencies): recomputed, dropped.
_BUFFERS = ("attention.bias", "attention.masked_bias", "attention.rotary_emb.inv_freq")


def _rename(name: str) -> str | None:
    return None if name.endswith(_BUFFERS) else name


def _options(cfg) -> dict:
    act = cfg.get("hidden_act")
    if act not in FFN:  # _check_features names the key first; this guards direct callers
        raise LayerConfigError(f"hidden_act {act!r} is not supported for gpt_neox")
    parallel = cfg.get("use_parallel_residual", True)
    if type(parallel) is not bool:
        raise LayerConfigError(f"use_parallel_residual must be true or false, got {parallel!r}")
    block = dataclasses.replace(BLOCK, ffn=FFN[act], parallel=parallel)
    return {"block": dataclasses.asdict(block)}


def gguf_rotary(get) -> dict:
    """AttentionConfig's partial_rotary_factor from rope.dimension_count: (rot + 0.5) / head_dim,
    whose int(head_dim * factor) is rot exactly (rot / head_dim can floor one short)."""
    head_dim = get("attention.key_length", None) or (
        get("embedding_length", 0) // get("attention.head_count", 1)
    )
    rot = get("rope.dimension_count", head_dim)
    return {"partial_rotary_factor": 1.0 if rot >= head_dim else (rot + 0.5) / head_dim}


def _gguf(get) -> dict:
    # llama.cpp's file records no activation: transformers' default, the exact GELU
    block = dataclasses.replace(BLOCK, parallel=bool(get("use_parallel_residual", True)))
    return {"block": dataclasses.asdict(block), "attention": gguf_rotary(get),
            "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}  # fmt: skip


FAMILY = Family(
    model_type="gpt_neox",
    causal_lm_class="GPTNeoXForCausalLM",
    bias_rule="flag",  # attention_bias biases query_key_value and dense alike
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=2048,
    sliding="none",
    gguf_arch="gptneox",
    # transformers' GPTNeoXConfig; rotary_pct / rotary_emb_base are the older files' names
    hf_defaults={
        "layer_norm_eps": 1e-5,
        "attention_bias": True,
        "hidden_act": "gelu",
        "use_parallel_residual": True,
        "rotary_pct": 0.25,
    },  # fmt: skip
    hf_aliases={
        "layer_norm_eps": "rms_norm_eps",
        "rotary_pct": "partial_rotary_factor",
        "rotary_emb_base": "rope_theta",
    },  # fmt: skip
    activations=tuple(FFN),
    tensors=TENSORS,
    global_tensors=GLOBALS,
    block=BLOCK,
    hf_block_prefix="gpt_neox.layers.{i}.",
    hf_rename=_rename,
    hf_options=_options,
    gguf_options=_gguf,
)

"""phi3 (Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini): llama's block with q, k and v fused in
`qkv_proj` ([q; k; v] rows) and the FFN's gate and up in `gate_up_proj` ([gate; up] rows), both
split at load; longrope scaling, an optional partial rotary (Phi-4-mini) and a sliding window on
every layer when `sliding_window` is set. mlx-lm: models/phi3.py."""

from entity.families.base import Family, TensorName
from entity.families.gpt_neox import gguf_rotary

TENSORS: tuple[TensorName, ...] = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn", "w_q+w_k+w_v", "self_attn.qkv_proj.weight", "attn_qkv.weight"),
    TensorName("attn", "w_o", "self_attn.o_proj.weight", "attn_output.weight"),
    TensorName("mlp_norm", "gamma", "post_attention_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp", "w_gate+w_up", "mlp.gate_up_proj.weight", "ffn_up.weight"),
    TensorName("mlp", "w_down", "mlp.down_proj.weight", "ffn_down.weight"),
)


def _gguf(get) -> dict:
    """llama.cpp's phi3: attention.sliding_window (0: none, Phi-4), rope.dimension_count; its
    longrope factors are tensors (entity.gguf.loader reads them)."""
    attention = gguf_rotary(get)
    window = get("attention.sliding_window", 0)
    if window:
        attention["sliding_window"] = window
    return {"attention": attention}


FAMILY = Family(
    model_type="phi3",
    causal_lm_class="Phi3ForCausalLM",
    bias_rule="none",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=4096,
    sliding="sliding_window",
    gguf_arch="phi3",
    # transformers' Phi3Config: longrope's pre-extension length is this top-level key
    hf_defaults={"rms_norm_eps": 1e-5, "original_max_position_embeddings": 4096},
    tensors=TENSORS,
    rope_aliases={"su": "longrope", "yarn": "longrope"},  # Phi3Config's own mapping
    gguf_options=_gguf,
)

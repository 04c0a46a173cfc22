"""glm4 (GLM-4-0414): sandwich norms (post_self_attn_layernorm after attention,
post_attention_layernorm before the FFN, post_mlp_layernorm after it), RoPE over the first
`partial_rotary_factor` (default 0.5) of each head with GPT-J pairs (2i, 2i+1), q/k/v biases
per `attention_bias` (default true; o_proj never has one) and the FFN's gate and up rows fused in `gate_up_proj` (gate first),
split at load. llama.cpp arch "glm4": the same names' tensors, q/k rows as HF stores them."""

from entity.families.base import Family, TensorName
from poly.errors import LayerConfigError
from poly.recipe import BlockRecipe

TENSORS: tuple[TensorName, ...] = (
    TensorName("attn_norm", "gamma", "input_layernorm.weight", "attn_norm.weight"),
    TensorName("attn", "w_q", "self_attn.q_proj.weight", "attn_q.weight"),
    TensorName("attn", "w_k", "self_attn.k_proj.weight", "attn_k.weight"),
    TensorName("attn", "w_v", "self_attn.v_proj.weight", "attn_v.weight"),
    TensorName("attn", "w_o", "self_attn.o_proj.weight", "attn_output.weight"),
    TensorName("attn", "b_q", "self_attn.q_proj.bias", "attn_q.bias"),
    TensorName("attn", "b_k", "self_attn.k_proj.bias", "attn_k.bias"),
    TensorName("attn", "b_v", "self_attn.v_proj.bias", "attn_v.bias"),
    TensorName("attn_post_norm", "gamma", "post_self_attn_layernorm.weight",
               "post_attention_norm.weight"),
    TensorName("mlp_norm", "gamma", "post_attention_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp", "w_gate+w_up", "mlp.gate_up_proj.weight", "ffn_up.weight"),
    TensorName("mlp", "w_down", "mlp.down_proj.weight", "ffn_down.weight"),
    TensorName("mlp_post_norm", "gamma", "post_mlp_layernorm.weight", "post_ffw_norm.weight"),
)  # fmt: skip


def _hf(cfg) -> dict:
    return {"attention": {"rope_interleaved": True}}


def _gguf(get) -> dict:
    head_dim = get("attention.key_length", None) or (
        get("embedding_length", 0) // get("attention.head_count", 1)
    )
    rot = get("rope.dimension_count", head_dim)
    if type(rot) is not int or not 0 < rot <= head_dim or rot % 2:
        raise LayerConfigError(
            f"rope.dimension_count {rot!r} must be even and in (0, head_dim {head_dim}]"
        )
    return {"attention": {"rope_interleaved": True, "partial_rotary_factor": rot / head_dim}}


FAMILY = Family(
    model_type="glm4",
    causal_lm_class="Glm4ForCausalLM",
    bias_rule="qkv_flag",
    qk_norm=False,
    default_head_dim=128,
    default_max_positions=131072,
    sliding="none",
    gguf_arch="glm4",
    hf_defaults={
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1.5625e-07,
    },  # fmt: skip
    tensors=TENSORS,
    block=BlockRecipe(post_norms=True),
    hf_options=_hf,
    gguf_options=_gguf,
)

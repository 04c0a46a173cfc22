"""olmo2 (OLMo 2): no pre-norms; each sub-layer reads the residual stream as is and its output is
RMS-normed before the residual add (post_attention_layernorm, post_feedforward_layernorm);
q and k are RMS-normed over all heads at once ([q_dim] / [kv_dim] weights) before RoPE.
llama.cpp arch "olmo2" (NeoX rotary: q/k rows as HF stores them)."""

from entity.families.base import LLAMA_TENSORS, Family, TensorName
from poly.recipe import BlockRecipe

_PRE_NORMS = {"attn_norm", "mlp_norm"}
TENSORS: tuple[TensorName, ...] = (
    *(t for t in LLAMA_TENSORS if t.role not in _PRE_NORMS),
    TensorName("attn_post_norm", "gamma", "post_attention_layernorm.weight",
               "post_attention_norm.weight"),
    TensorName("mlp_post_norm", "gamma", "post_feedforward_layernorm.weight",
               "post_ffw_norm.weight"),
)  # fmt: skip


def _options(_cfg) -> dict:
    return {"attention": {"qk_norm_all": True}}


FAMILY = Family(
    model_type="olmo2",
    causal_lm_class="Olmo2ForCausalLM",
    bias_rule="flag",
    qk_norm=True,
    default_head_dim=None,
    default_max_positions=2048,
    sliding="none",
    gguf_arch="olmo2",
    hf_defaults={"rms_norm_eps": 1e-5},
    tensors=TENSORS,
    block=BlockRecipe(post_norms=True, pre_norms=False),
    hf_options=_options,
    gguf_options=_options,
)

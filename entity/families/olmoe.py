"""olmoe (OLMoE): llama's block with q/k RMSNorm over all heads at once ([q_dim]/[kv_dim]
weights) and a softmax top-k MoE of SwiGLU experts that is not renormalised by default."""

from entity.families.base import QWEN_PROJ, Family, MoENames
from poly.errors import LayerConfigError


def _options(cfg) -> dict:
    if cfg.get("clip_qkv") is not None:  # transformers clamps q/k/v; no released OLMoE sets it
        raise LayerConfigError("clip_qkv is not supported for olmoe")
    return {"attention": {"qk_norm_all": True}}


FAMILY = Family(
    model_type="olmoe",
    causal_lm_class="OlmoeForCausalLM",
    bias_rule="flag",
    qk_norm=True,
    default_head_dim=None,
    default_max_positions=4096,
    sliding="none",
    gguf_arch="olmoe",
    moe=MoENames(prefix="mlp.", proj=QWEN_PROJ, width_key="intermediate_size", norm_topk=False),
    hf_options=_options,
    gguf_options=lambda get: {"attention": {"qk_norm_all": True}},
)

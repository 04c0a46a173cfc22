"""qwen3_moe: qwen3's attention (q/k norm), softmax top-k experts renormalised by default."""

from entity.families.base import QWEN_PROJ, Family, MoENames

FAMILY = Family(
    model_type="qwen3_moe",
    causal_lm_class="Qwen3MoeForCausalLM",
    bias_rule="flag",
    qk_norm=True,
    default_head_dim=None,
    default_max_positions=32768,
    sliding="use_sliding_window",
    gguf_arch="qwen3moe",
    moe=MoENames(prefix="mlp.", proj=QWEN_PROJ, width_key="moe_intermediate_size"),
)

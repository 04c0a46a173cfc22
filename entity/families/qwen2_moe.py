"""qwen2_moe: qwen2's attention, softmax top-k experts plus a sigmoid-gated shared expert."""

from entity.families.base import QWEN_PROJ, Family, MoENames

FAMILY = Family(
    model_type="qwen2_moe",
    causal_lm_class="Qwen2MoeForCausalLM",
    bias_rule="qkv",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=32768,
    sliding="use_sliding_window",
    gguf_arch="qwen2moe",
    moe=MoENames(
        prefix="mlp.",
        proj=QWEN_PROJ,
        width_key="moe_intermediate_size",
        shared=True,
        norm_topk=False,
    ),  # fmt: skip
)

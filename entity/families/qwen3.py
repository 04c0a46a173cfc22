"""qwen3: llama's block with per-head q/k RMSNorm; head_dim 128 by default."""

from entity.families.base import Family

FAMILY = Family(
    model_type="qwen3",
    causal_lm_class="Qwen3ForCausalLM",
    bias_rule="flag",
    qk_norm=True,
    default_head_dim=128,
    default_max_positions=32768,
    sliding="use_sliding_window",
    gguf_arch="qwen3",
)

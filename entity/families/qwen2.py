"""qwen2: llama's block with q/k/v biases (o unbiased)."""

from entity.families.base import Family

FAMILY = Family(
    model_type="qwen2",
    causal_lm_class="Qwen2ForCausalLM",
    bias_rule="qkv",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=32768,
    sliding="use_sliding_window",
    gguf_arch="qwen2",
)

"""mistral: llama's block with a sliding window; GGUF files say "llama"."""

from entity.families.base import Family

FAMILY = Family(
    model_type="mistral",
    causal_lm_class="MistralForCausalLM",
    bias_rule="none",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=131072,
    sliding="sliding_window",
    gguf_arch="llama",
    permute_qk=True,
)

"""llama (Llama 1-3, SmolLM, TinyLlama...): the pre-norm SwiGLU block every recipe starts from."""

from entity.families.base import Family

FAMILY = Family(
    model_type="llama",
    causal_lm_class="LlamaForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=2048,
    sliding="none",
    gguf_arch="llama",
    permute_qk=True,
)

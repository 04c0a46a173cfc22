"""mixtral: mistral's attention, a softmax top-k MoE of SwiGLU experts (w1/w3/w2) in every layer;
GGUF files say "llama"."""

from entity.families.base import Family, MoENames

FAMILY = Family(
    model_type="mixtral",
    causal_lm_class="MixtralForCausalLM",
    bias_rule="none",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=131072,
    sliding="sliding_window",
    gguf_arch="llama",
    permute_qk=True,
    moe=MoENames(
        prefix="block_sparse_moe.",
        proj={"w_gate": "w1", "w_up": "w3", "w_down": "w2"},
        width_key="intermediate_size",
        norm_topk=True,
        norm_topk_key=False,
    ),
)

"""granitemoe (Granite 3.x MoE): llama's block with four multipliers (embeddings, each residual
branch, the attention logit scale, the logits divided by `logits_scaling`) and a softmax top-k
MoE whose experts are stored as stacks (`input_linear` gate|up, `output_linear`)."""

from entity.families.base import Family, MoENames


def _options(cfg) -> dict:
    return {
        "embedding_scale": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "logit_scale": 1.0 / float(cfg.get("logits_scaling", 1.0)),
        "attention": {"scale": float(cfg.get("attention_multiplier", 1.0))},
    }


def _gguf_options(get) -> dict:
    # llama.cpp's converter writes the four as embedding_scale, residual_scale, logit_scale
    # (the divisor, as in config.json) and attention.scale.
    return {
        "embedding_scale": float(get("embedding_scale", 1.0)),
        "residual_multiplier": float(get("residual_scale", 1.0)),
        "logit_scale": 1.0 / float(get("logit_scale", 1.0)),
        "attention": {"scale": float(get("attention.scale", 1.0))},
    }


FAMILY = Family(
    model_type="granitemoe",
    causal_lm_class="GraniteMoeForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=2048,
    sliding="none",
    gguf_arch="granitemoe",
    permute_qk=True,  # llama.cpp's GraniteMoeModel is a LlamaModel
    # softmax over the top-k logits equals the top-k of the softmax renormalised (llama.cpp's
    # norm_w = true): the fused C step's form
    moe=MoENames(
        prefix="block_sparse_moe.",
        proj={},
        width_key="intermediate_size",
        norm_topk=True,
        norm_topk_key=False,
        router="router.layer.weight",
        layout="granite",
    ),
    hf_options=_options,
    gguf_options=_gguf_options,
)

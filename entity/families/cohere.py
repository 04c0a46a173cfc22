"""cohere (Command-R): one LayerNorm without a bias (mean subtracted, weight only) feeds
attention and the SwiGLU MLP in parallel, x + attn(ln(x)) + mlp(ln(x)); RoPE on GPT-J pairs
(2i, 2i+1); logits times `logit_scale`; q/k/v/o biases per `attention_bias`. `use_qk_norm`
(Command-R+): a LayerNorm without a bias over each head of q and k, each head its own weights
(stored [heads, head_dim]), before RoPE. mlx-lm: models/cohere.py."""

from entity.families.base import LLAMA_TENSORS, Family, TensorName
from poly.errors import LayerConfigError
from poly.recipe import BlockRecipe

BLOCK = BlockRecipe(norm="layernorm_nobias", parallel=True, shared_norm=True)
_DROPPED = {"mlp_norm"}
QK_NORM = {"qk_norm_kind": "layernorm_nobias", "qk_norm_heads": True}
TENSORS: tuple[TensorName, ...] = tuple(
    t for t in LLAMA_TENSORS if t.role not in _DROPPED and t.component not in _DROPPED
)


def _options(cfg) -> dict:
    qk = cfg.get("use_qk_norm")
    if type(qk) is not bool:
        raise LayerConfigError(f"use_qk_norm must be true or false, got {qk!r}")
    scale = cfg.get("logit_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise LayerConfigError(f"logit_scale must be a positive number, got {scale!r}")
    attention = {"rope_interleaved": True}
    if qk:
        attention |= QK_NORM
    return {"logit_scale": float(scale), "attention": attention, "qk_norm": qk}


def _gguf(get) -> dict:
    return {"logit_scale": float(get("logit_scale", 0.0625)),
            "attention": {"rope_interleaved": True},
            "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}  # fmt: skip


FAMILY = Family(
    model_type="cohere",
    causal_lm_class="CohereForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=8192,
    sliding="none",
    gguf_arch="command-r",
    # transformers' CohereConfig
    hf_defaults={
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.0625,
        "tie_word_embeddings": True,
        "use_qk_norm": False,
    },  # fmt: skip
    hf_aliases={"layer_norm_eps": "rms_norm_eps"},
    tensors=TENSORS,
    block=BLOCK,
    hf_options=_options,
    qk_norm_options=QK_NORM,
    gguf_options=_gguf,
)

"""granite (Granite 3.x dense): llama's block with four multipliers: the embeddings times
`embedding_multiplier`, each residual branch times `residual_multiplier`, the attention logits
scaled by `attention_multiplier` (not head_dim ** -0.5) and the logits divided by
`logits_scaling`. llama.cpp's converter (GraniteModel, a LlamaModel: q/k rows permuted) writes
them as embedding_scale, residual_scale, attention.scale and logit_scale (the divisor)."""

from entity.families.base import Family
from poly.errors import LayerConfigError

# config.json key -> GGUF key (`{arch}.<key>`) of each multiplier
KEYS = {
    "embedding_multiplier": "embedding_scale",
    "residual_multiplier": "residual_scale",
    "attention_multiplier": "attention.scale",
    "logits_scaling": "logit_scale",
}


def _positive(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LayerConfigError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def multipliers(get, gguf: bool = False) -> dict:
    """TransformerConfig fields from `get(key)` of the four multipliers (config.json names; an
    error names the file's key)."""
    m = {key: _positive(KEYS[key] if gguf else key, get(key)) for key in KEYS}
    return {
        "embedding_scale": m["embedding_multiplier"],
        "residual_multiplier": m["residual_multiplier"],
        "logit_scale": 1.0 / m["logits_scaling"],
        "attention": {"scale": m["attention_multiplier"]},
    }


def _hf(cfg) -> dict:
    return multipliers(lambda key: cfg.get(key, 1.0))


def _gguf(get) -> dict:
    return multipliers(lambda key: get(KEYS[key], 1.0), gguf=True)


FAMILY = Family(
    model_type="granite",
    causal_lm_class="GraniteForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=2048,
    sliding="none",
    gguf_arch="granite",
    permute_qk=True,
    hf_options=_hf,
    gguf_options=_gguf,
)

"""gemma3_text (and the text part of gemma3 checkpoints): Gemma 2's block with per-head q/k
(1 + w) RMSNorm, no soft-capping by default, five sliding layers to one global, the sliding
layers rotating with rope_local_base_freq (10000) unscaled, the global ones with rope_theta and
its scaling. mlx-lm: models/gemma3_text.py; llama.cpp arch "gemma3"."""

from __future__ import annotations

from entity.families.base import Family
from entity.families.gemma import GELU_TANH, check_activation, embedding_scale
from entity.families.gemma2 import TENSORS, gguf_attention, hf_attention
from poly.errors import ConfigError
from poly.recipe import BlockRecipe

LOCAL_THETA = 10000.0  # transformers' default_theta["local"], llama.cpp's rope_freq_base_train_swa


def _local_theta(config) -> float:
    params = config.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    theta = (local or {}).get("rope_theta", config.get("rope_local_base_freq", LOCAL_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"rope_local_base_freq: must be a positive number, got {theta!r}")
    return float(theta)


def _hf(config) -> dict:
    check_activation(config)
    period = config.get("sliding_window_pattern", 6)
    if type(period) is not int or period <= 0:
        raise ConfigError(f"sliding_window_pattern: must be a positive integer, got {period!r}")
    attention = hf_attention(config, period) | {"local_rope_theta": _local_theta(config)}
    out = {"embedding_scale": embedding_scale(config["hidden_size"]), "attention": attention}
    cap = config.get("final_logit_softcapping")
    if cap is not None:
        out["final_logit_softcap"] = float(cap)
    return out


def _gguf(get) -> dict:
    # the sliding layers' base: rope.freq_base_swa (the converter writes rope_parameters'
    # sliding_attention theta there), llama.cpp's 10000 without it
    local = get("rope.freq_base_swa", LOCAL_THETA)
    if isinstance(local, bool) or not isinstance(local, (int, float)) or local <= 0:
        raise ConfigError(f"rope.freq_base_swa: must be a positive number, got {local!r}")
    attention = gguf_attention(get, 6, 62) | {"local_rope_theta": float(local)}
    return {"embedding_scale": embedding_scale(get("embedding_length", None)),
            "attention": attention}  # fmt: skip


def hf_rename(name: str) -> str | None:
    """Gemma3ForConditionalGeneration names -> the text model's (vision tensors dropped)."""
    for prefix in ("model.language_model.", "language_model.model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return (
        name if name.startswith(("model.layers.", "model.norm", "model.embed", "lm_head")) else None
    )


FAMILY = Family(
    model_type="gemma3_text",
    causal_lm_class="Gemma3ForCausalLM",
    other_classes=("Gemma3ForConditionalGeneration",),
    wrapper_types=("gemma3",),
    bias_rule="flag",
    qk_norm=True,
    default_head_dim=256,
    default_max_positions=131072,
    sliding="sliding_window",
    gguf_arch="gemma3",
    hf_defaults={
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "rope_theta": 1_000_000.0,
    },  # fmt: skip
    activations=GELU_TANH,
    tensors=TENSORS,
    block=BlockRecipe(ffn="geglu", post_norms=True),
    norm_offset=1.0,
    hf_rename=hf_rename,
    hf_options=_hf,
    gguf_options=_gguf,
)

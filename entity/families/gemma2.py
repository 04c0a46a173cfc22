"""gemma2: Gemma's block with sandwich norms (post-attention and post-FFN RMSNorms), attention
logits scaled by query_pre_attn_scalar ** -0.5 and soft-capped, final logits soft-capped, and a
sliding window on every other layer (even layers slide). mlx-lm: models/gemma2.py; llama.cpp
arch "gemma2" (its attention scale is 1/sqrt(head_dim) for every size but 27B)."""

from __future__ import annotations

import numpy as np

from entity.families.base import LLAMA_TENSORS, Family, TensorName
from entity.families.gemma import GELU_TANH, check_activation, embedding_scale
from poly.errors import ConfigError
from poly.recipe import BlockRecipe

_MLP_NORM = {"mlp_norm"}
# post_attention_layernorm is the attention branch's post-norm here, not the FFN's pre-norm.
TENSORS: tuple[TensorName, ...] = (
    *(t for t in LLAMA_TENSORS if t.role not in _MLP_NORM),
    TensorName("attn_post_norm", "gamma", "post_attention_layernorm.weight",
               "post_attention_norm.weight"),
    TensorName("mlp_norm", "gamma", "pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    TensorName("mlp_post_norm", "gamma", "post_feedforward_layernorm.weight",
               "post_ffw_norm.weight"),
)  # fmt: skip


def _positive(config, key: str):
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{key}: must be a positive number, got {value!r}")
    return float(value)


def window_layers(config, period: int) -> list[int]:
    """Layers with a sliding window: config.json's layer_types, else all but every period-th."""
    types = config.get("layer_types")
    n = config["num_hidden_layers"]
    if types is None:
        return [i for i in range(n) if (i + 1) % period]
    if not isinstance(types, list) or len(types) != n:
        raise ConfigError(f"layer_types: must list one type per layer ({n})")
    known = {"sliding_attention", "full_attention"}
    bad = [t for t in types if t not in known]
    if bad:
        raise ConfigError(f"layer_types: unknown layer type {bad[0]!r}")
    return [i for i, t in enumerate(types) if t == "sliding_attention"]


def hf_attention(config, period: int) -> dict:
    """AttentionConfig fields of Gemma 2 and 3."""
    scalar = _positive(config, "query_pre_attn_scalar")
    out = {"window_layers": window_layers(config, period)}
    if scalar is not None:
        out["scale"] = scalar**-0.5
    cap = _positive(config, "attn_logit_softcapping")
    if cap is not None:
        out["softcap"] = cap
    return out


def _hf(config) -> dict:
    check_activation(config)
    out = {"embedding_scale": embedding_scale(config["hidden_size"]),
           "attention": hf_attention(config, 2)}  # fmt: skip
    cap = _positive(config, "final_logit_softcapping")
    if cap is not None:
        out["final_logit_softcap"] = cap
    return out


def gguf_window_layers(get, layers: int, period: int) -> list[int]:
    """Sliding layers as llama.cpp reads them: attention.sliding_window_pattern, a flag per
    layer or a period n (layer i slides when i % n < n - 1; 0: all), else the family's period."""
    pattern = get("attention.sliding_window_pattern", period)
    if isinstance(pattern, np.ndarray):
        if len(pattern) < layers:
            raise ConfigError(
                f"attention.sliding_window_pattern: {len(pattern)} flags for {layers} layers"
            )
        return [i for i in range(layers) if pattern[i]]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise ConfigError(f"attention.sliding_window_pattern: bad value {pattern!r}")
    return [i for i in range(layers) if pattern == 0 or i % pattern < pattern - 1]


def gguf_attention(get, period: int, big_layers: int) -> dict:
    """AttentionConfig fields from the GGUF keys. The files carry no query_pre_attn_scalar:
    llama.cpp scales by head_dim ** -0.5, by (hidden / heads) ** -0.5 for the 27B model (the
    one whose block count is `big_layers`), which is what each released size's scalar is."""
    layers, window = get("block_count", 0), get("attention.sliding_window", None)
    out: dict = {"window_layers": gguf_window_layers(get, layers, period)}
    if window is not None:
        out["sliding_window"] = window
    cap = get("attn_logit_softcapping", None)
    if cap:
        out["softcap"] = float(cap)
    if layers == big_layers:
        hidden, heads = get("embedding_length", None), get("attention.head_count", None)
        if isinstance(hidden, int) and isinstance(heads, int) and 0 < heads <= hidden:
            out["scale"] = float(hidden // heads) ** -0.5
    return out


def _gguf(get) -> dict:
    out = {"embedding_scale": embedding_scale(get("embedding_length", None)),
           "attention": gguf_attention(get, 2, 46)}  # fmt: skip
    cap = get("final_logit_softcapping", None)
    if cap:
        out["final_logit_softcap"] = float(cap)
    return out


FAMILY = Family(
    model_type="gemma2",
    causal_lm_class="Gemma2ForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=256,
    default_max_positions=8192,
    sliding="sliding_window",
    gguf_arch="gemma2",
    hf_defaults={
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },  # fmt: skip
    activations=GELU_TANH,
    tensors=TENSORS,
    block=BlockRecipe(ffn="geglu", post_norms=True),
    norm_offset=1.0,
    hf_options=_hf,
    gguf_options=_gguf,
)

"""gemma (Gemma 1): llama's pre-norm block with GeGLU (gelu_pytorch_tanh), (1 + w) RMSNorm,
embeddings scaled by sqrt(hidden) (rounded to float32, as transformers' normalizer), head_dim
256 and tied embeddings by default. mlx-lm: models/gemma.py; llama.cpp arch "gemma"."""

from __future__ import annotations

import math

import numpy as np

from entity.families.base import Family
from poly.errors import ConfigError
from poly.recipe import BlockRecipe

GELU_TANH = ("gelu_pytorch_tanh", "gelu")  # transformers maps Gemma's legacy "gelu" to tanh


def embedding_scale(hidden) -> float:
    if type(hidden) is not int or hidden <= 0:
        raise ConfigError(f"hidden_size: must be a positive integer, got {hidden!r}")
    return float(np.float32(math.sqrt(hidden)))


def check_activation(config, key: str = "hidden_activation") -> None:
    value = config.get(key, "gelu_pytorch_tanh")
    if value is not None and value not in GELU_TANH:
        raise ConfigError(f"{key}: {value!r} is not supported (gelu_pytorch_tanh only)")


def _hf(config) -> dict:
    check_activation(config)
    return {"embedding_scale": embedding_scale(config["hidden_size"])}


def _gguf(get) -> dict:
    return {"embedding_scale": embedding_scale(get("embedding_length", None))}


FAMILY = Family(
    model_type="gemma",
    causal_lm_class="GemmaForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=256,
    default_max_positions=8192,
    sliding="none",
    gguf_arch="gemma",
    hf_defaults={"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True},
    activations=GELU_TANH,
    block=BlockRecipe(ffn="geglu"),
    norm_offset=1.0,
    hf_options=_hf,
    gguf_options=_gguf,
)

"""cohere2 (Command R7B, Command A): Command-R's block (one LayerNorm without a bias feeding
attention and SwiGLU in parallel, RoPE on GPT-J pairs, `logit_scale`) with sliding windows on
the layers `layer_types` names (default: three sliding to one global) and RoPE on the sliding
layers only (the global ones are NoPE). mlx-lm: models/cohere2.py; llama.cpp arch "cohere2"
(window pattern 4, RoPE on the sliding layers)."""

from entity.families.base import Family
from entity.families.cohere import BLOCK, TENSORS
from entity.families.gemma2 import gguf_window_layers, window_layers
from poly.errors import LayerConfigError

PERIOD = 4  # transformers' and llama.cpp's default: every 4th layer global


def _attention(layers: int, sliding: list[int]) -> dict:
    nope = [i for i in range(layers) if i not in sliding]
    return {"rope_interleaved": True, "window_layers": sliding, "nope_layers": nope}


def _hf(cfg) -> dict:
    scale = cfg.get("logit_scale")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise LayerConfigError(f"logit_scale must be a positive number, got {scale!r}")
    sliding = window_layers(cfg, cfg.get("sliding_window_pattern", PERIOD))
    return {"logit_scale": float(scale),
            "attention": _attention(cfg["num_hidden_layers"], sliding)}  # fmt: skip


def _gguf(get) -> dict:
    layers = get("block_count", 0)
    attention = _attention(layers, gguf_window_layers(get, layers, PERIOD))
    window = get("attention.sliding_window", None)
    if window is not None:
        attention["sliding_window"] = window
    return {"logit_scale": float(get("logit_scale", 0.0625)), "attention": attention,
            "rms_norm_eps": float(get("attention.layer_norm_epsilon", 1e-5))}  # fmt: skip


FAMILY = Family(
    model_type="cohere2",
    causal_lm_class="Cohere2ForCausalLM",
    bias_rule="flag",
    qk_norm=False,
    default_head_dim=None,
    default_max_positions=8192,
    sliding="sliding_window",
    gguf_arch="cohere2",
    # transformers' Cohere2Config
    hf_defaults={
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.0625,
        "tie_word_embeddings": True,
        "sliding_window": 4096,
    },  # fmt: skip
    hf_aliases={"layer_norm_eps": "rms_norm_eps"},
    tensors=TENSORS,
    block=BLOCK,
    hf_options=_hf,
    gguf_options=_gguf,
)

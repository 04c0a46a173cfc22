"""How one decoder block is wired: its attention options (AttentionConfig) and its norm / FFN
recipe (BlockRecipe); both are fields of poly.config.TransformerConfig."""

from __future__ import annotations

import math
from dataclasses import dataclass

from poly.errors import LayerConfigError


def coerce_record(cls, value, what: str):
    """None, a `cls` record or its dict form (as a .entity header stores it) -> None or `cls`;
    anything else is a LayerConfigError naming `what`."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        try:
            return cls(**value)
        except TypeError as exc:
            raise LayerConfigError(f"bad {what} config: {exc}") from None
    raise LayerConfigError(f"bad {what} config {value!r}")


# Block recipe kinds. Norms: RMSNorm, LayerNorm with or without a bias. (1 + w) RMSNorm (Gemma)
# is a storage convention, not a kind: importers add the 1 (llama.cpp's converter does too), so
# every path runs the plain RMSNorm. FFNs: SwiGLU (silu gated), GeGLU (gelu_tanh gated), a plain
# biased GELU MLP; the sparse layers of an MoE model are TransformerConfig.moe, never a kind.
NORM_KINDS = ("rms", "layernorm", "layernorm_nobias")
FFN_KINDS = ("swiglu", "geglu", "gelu_mlp", "gelu_tanh_mlp")


@dataclass(frozen=True)
class AttentionConfig:
    """Attention options beyond causal GQA with RoPE over whole heads (poly.nn.mha; None and the
    defaults mean llama's attention). Per-layer lists name layers by index."""

    sliding_window: int | None = None  # keys a query sees, itself included (None: all)
    window_layers: tuple[int, ...] | None = None  # the layers that slide (None: every layer)
    partial_rotary_factor: float = 1.0  # RoPE over the first share of each head (phi, glm4)
    rope_interleaved: bool = False  # pairs (2i, 2i+1) as GPT-J/glm4, not (i, i + dim/2)
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (smollm3)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (gemma2)
    sinks: bool = False  # a learned per-head logit in the softmax denominator (gpt_oss)
    qk_norm_all: bool = False  # q/k RMSNorm over all heads at once (olmo2), not per head
    # q/k norm (TransformerConfig.qk_norm) over each head: "rms", or a LayerNorm with a bias
    # ("layernorm": phi's qk_layernorm) or without ("layernorm_nobias": cohere's use_qk_norm)
    qk_norm_kind: str = "rms"
    qk_norm_heads: bool = False  # one q/k norm weight per head ([q]/[kv]: cohere), not shared
    scale: float | None = None  # logit scale (granite, gemma2); None: head_dim ** -0.5
    # gemma3: sliding layers rotate with this base, unscaled (global ones: rope_theta, scaling)
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        w = self.sliding_window
        if w is not None and (type(w) is not int or w <= 0):
            raise LayerConfigError(f"sliding_window must be a positive integer, got {w!r}")
        for name in ("window_layers", "nope_layers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(i) for i in value))
        if self.qk_norm_kind not in NORM_KINDS:
            raise LayerConfigError(
                f"qk_norm_kind {self.qk_norm_kind!r} is not one of {', '.join(NORM_KINDS)}"
            )
        if self.qk_norm_heads and self.qk_norm_all:
            raise LayerConfigError("qk_norm_heads and qk_norm_all exclude each other")
        f = self.partial_rotary_factor
        if not (isinstance(f, (int, float)) and 0 < f <= 1):
            raise LayerConfigError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        for name in ("softcap", "scale"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
            ):
                raise LayerConfigError(f"attention {name} must be a positive number, got {value!r}")

    def window_of(self, index: int) -> int:
        """Layer `index`'s sliding window, 0 for full attention."""
        lay = self.window_layers
        return (self.sliding_window or 0) if lay is None or index in lay else 0

    def rotary_dim(self, head_dim: int, index: int) -> int:
        """Dims of each head layer `index` rotates (0: a NoPE layer)."""
        if index in self.nope_layers:
            return 0
        dim = int(head_dim * self.partial_rotary_factor)
        if dim % 2:
            raise LayerConfigError(
                f"partial_rotary_factor {self.partial_rotary_factor} of head_dim {head_dim} "
                "rotates an odd number of dims"
            )
        return dim

    @classmethod
    def coerce(cls, value) -> AttentionConfig | None:
        """None, an AttentionConfig or its dict form (as stored in a .entity header)."""
        return coerce_record(cls, value, "attention")


@dataclass(frozen=True)
class BlockRecipe:
    """How one decoder block is wired (the TransformerBlock of mlx-lm's models/*.py); the
    defaults are llama's pre-norm block, x + attn(norm(x)) then + ffn(norm(.)).

    `post_norms`: sandwich norms, each sub-layer's output is normed before its residual add
    (Gemma 2/3, GLM-4; OLMo 2 has the post-norms only, see `pre_norms`).
    `parallel`: x + attn(norm1(x)) + ffn(norm2(x)) (GPT-NeoX, Phi-2, Command-R); with
    `shared_norm` the FFN reads the attention norm's output and the block has no mlp_norm.
    `mlp_bias`: the FFN projections carry biases. `pre_norms` False (with `post_norms`): the
    sub-layers read the residual stream unnormed, only their outputs are normed (OLMo 2)."""

    norm: str = "rms"
    ffn: str = "swiglu"
    mlp_bias: bool = False
    post_norms: bool = False
    parallel: bool = False
    shared_norm: bool = False
    pre_norms: bool = True

    def __post_init__(self) -> None:
        if self.norm not in NORM_KINDS:
            raise LayerConfigError(
                f"block.norm {self.norm!r} is not one of {', '.join(NORM_KINDS)}"
            )
        if self.ffn not in FFN_KINDS:
            raise LayerConfigError(f"block.ffn {self.ffn!r} is not one of {', '.join(FFN_KINDS)}")
        for name in ("mlp_bias", "post_norms", "parallel", "shared_norm", "pre_norms"):
            if type(getattr(self, name)) is not bool:
                raise LayerConfigError(f"block.{name} must be true or false")
        if self.parallel and self.post_norms:
            raise LayerConfigError("block.parallel and block.post_norms exclude each other")
        if self.shared_norm and not self.parallel:
            raise LayerConfigError("block.shared_norm needs block.parallel")
        if not (self.pre_norms or self.post_norms):
            raise LayerConfigError("block.pre_norms false needs block.post_norms")

    @property
    def plain(self) -> bool:
        """llama's block (the one the fused C step and tensor parallelism implement)."""
        return self == PLAIN_BLOCK


PLAIN_BLOCK = BlockRecipe()

"""Frozen, validated configuration records for transformers built on the grid."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from poly.errors import LayerConfigError, LimitExceededError
from poly.recipe import PLAIN_BLOCK, AttentionConfig, BlockRecipe, coerce_record
from poly.rope import RopeScaling

# "softmax_topk": the top k of the raw logits, softmax over those k (GPT-OSS, GraniteMoE).
GATINGS = ("softmax", "sigmoid", "softmax_topk")
# Expert activations: "silu" = silu(gate) * up; "swiglu_oai" = GPT-OSS's clamped form
# (gate clamped above at limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)).
EXPERT_ACTIVATIONS = ("silu", "swiglu_oai")

# Upper bounds of every count a model file declares (GGUF metadata, HF config.json, a `.entity`
# header), checked when a config is built, before anything is allocated: a 465 KB header that
# asked for 10^6 experts built 10^6 expert objects per layer and died in a MemoryError. Each
# bound is several times the largest released model's (DeepSeek-V3: 256 experts, 61 layers;
# Llama-3.1-405B: 16384 wide, 128 heads; Gemma 3: 262144 tokens).
LIMITS: dict[str, int] = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "num_layers": 512,  # llama.cpp LLAMA_MAX_LAYERS
    "num_heads": 1024,
    "num_kv_heads": 1024,
    "head_dim": 1024,
    "max_seq_len": 1 << 24,  # the context a file may declare (KV caches are sized apart)
    "num_experts": 512,  # llama.cpp LLAMA_MAX_EXPERTS
    "top_k": 64,  # experts used per token
    "expert_intermediate_size": 1 << 18,
    "shared_intermediate_size": 1 << 18,
}


def check_limits(record, names=None) -> None:
    """LimitExceededError for the first count of `record` (a config) past its `LIMITS` bound."""
    for name in names or LIMITS:
        value = getattr(record, name, None)
        if type(value) is int and value > LIMITS[name]:
            raise LimitExceededError(f"{name} {value} exceeds the limit {LIMITS[name]}")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN (poly.nn.moe): a float32 router [E x d] picks `top_k` of
    `num_experts` SwiGLU experts of width `expert_intermediate_size` per token; `gating` turns
    router logits into weights, renormalised over the chosen k when `norm_topk_prob`.
    `shared_intermediate_size` > 0 adds an always-on SwiGLU expert scaled by sigmoid(w_sg . x)
    (Qwen2-MoE). Layers listed in `dense_layers` keep the dense SwiGLU of the model.
    `router_bias` adds a bias [E] to the router logits and `expert_bias` says the experts carry
    biases (GPT-OSS); `activation` with `swiglu_alpha`/`swiglu_limit` picks the experts' gated
    activation (EXPERT_ACTIVATIONS)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    gating: str = "softmax"
    norm_topk_prob: bool = True
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        check_limits(self, ("num_experts", "top_k", "expert_intermediate_size",
                            "shared_intermediate_size"))  # fmt: skip
        _positive("num_experts", self.num_experts)
        _positive("top_k", self.top_k)
        _positive("expert_intermediate_size", self.expert_intermediate_size)
        if self.top_k > self.num_experts:
            raise LayerConfigError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if self.gating not in GATINGS:
            raise LayerConfigError(f"gating {self.gating!r} is not one of {', '.join(GATINGS)}")
        if not isinstance(self.shared_intermediate_size, int) or self.shared_intermediate_size < 0:
            raise LayerConfigError("shared_intermediate_size must be an integer >= 0")
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        if self.activation not in EXPERT_ACTIVATIONS:
            raise LayerConfigError(
                f"moe activation {self.activation!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}"
            )
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise LayerConfigError(f"{name} must be a positive finite number, got {value!r}")

    @property
    def extended(self) -> bool:
        """True when an option past llama/Qwen's MoE is used (softmax_topk gating, biases, the
        clamped activation: GPT-OSS, GraniteMoE); the fused C step runs them too."""
        return self.gating not in ("softmax", "sigmoid") or bool(
            self.router_bias or self.expert_bias or self.activation != "silu"
        )

    @classmethod
    def coerce(cls, value) -> MoEConfig | None:
        """None, a MoEConfig or its dict form (as stored in a .entity header)."""
        return coerce_record(cls, value, "moe")


def _coerce_fields(cfg) -> None:
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, dict) and f.name in NESTED:
            try:
                value = NESTED[f.name](**value)
            except TypeError as exc:
                raise LayerConfigError(f"bad {f.name}: {exc}") from None
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        object.__setattr__(cfg, f.name, value)


def _finite(name: str, value, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise LayerConfigError(f"{name} must be a {'positive' if positive else 'non-negative'} "
                               f"finite number, got {value!r}")  # fmt: skip


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayerConfigError(f"{name} must be a positive integer, got {value!r}")


# Fields holding a nested record: a `.entity` header stores them as maps (to_dict) and they come
# back through from_dict; lists come back as tuples (configs are hashed).
NESTED: dict[str, type] = {"rope_scaling": RopeScaling, "block": BlockRecipe}


@dataclass(frozen=True)
class TransformerConfig:
    """A transformer model's shape and options, validated once (`__post_init__`): the sizes,
    norms, rope, block recipe and MoE of a model; `.entity` headers store it (`to_dict`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int = 0  # 0 = num_heads
    head_dim: int = 0  # 0 = hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    architecture: str = "llama"
    moe: MoEConfig | None = None
    attention: AttentionConfig | None = None
    block: BlockRecipe = PLAIN_BLOCK
    # Model-level multipliers (1.0 / 0.0: off): embeddings x embedding_scale (Gemma sqrt(hidden),
    # Granite), each residual branch x residual_multiplier (Granite), logits x logit_scale
    # (Command-R; Granite's 1/logits_scaling), then cap * tanh(logits / cap) (Gemma 2).
    embedding_scale: float = 1.0
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    final_logit_softcap: float = 0.0
    lm_head_bias: bool = False  # the LM head adds a bias [vocab] (Phi-2)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_limits(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                            "num_heads", "num_kv_heads", "head_dim", "max_seq_len"))  # fmt: skip
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            _positive(name, getattr(self, name))
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise LayerConfigError(
                    "hidden_size must be divisible by num_heads without head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _positive("num_kv_heads", self.num_kv_heads)
        _positive("head_dim", self.head_dim)
        _positive("max_seq_len", self.max_seq_len)
        if self.num_heads % self.num_kv_heads:
            raise LayerConfigError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise LayerConfigError("head_dim must be even for rotary embeddings")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise LayerConfigError(f"{name} must be a positive finite number, got {value!r}")
        _coerce_fields(self)
        object.__setattr__(self, "moe", MoEConfig.coerce(self.moe))
        for name in ("embedding_scale", "residual_multiplier", "logit_scale"):
            _finite(name, getattr(self, name), positive=True)
        _finite("final_logit_softcap", self.final_logit_softcap, positive=False)
        object.__setattr__(self, "attention", AttentionConfig.coerce(self.attention))
        dense = () if self.moe is None else self.moe.dense_layers
        if any(not 0 <= i < self.num_layers for i in dense) or len(set(dense)) < len(dense):
            raise LayerConfigError(  # a dense layer outside the model named no layer at all
                f"moe.dense_layers {list(dense)} must be distinct layers in [0, {self.num_layers})"
            )

    @property
    def plain(self) -> bool:
        """llama's block and no model-level multiplier: what the fused C step implements."""
        return self.block.plain and not self.lm_head_bias and (
            self.embedding_scale, self.residual_multiplier, self.logit_scale,
            self.final_logit_softcap) == (1, 1, 1, 0)  # fmt: skip

    @property
    def query_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def parameter_count(self) -> int:
        """Weights of the model as HF counts them (q/k/v biases when attention_bias)."""
        h, q, kv = self.hidden_size, self.query_dim, self.kv_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        opts = self.attention or AttentionConfig()
        if self.qk_norm:
            norms = q + kv if opts.qk_norm_all or opts.qk_norm_heads else 2 * self.head_dim
            attn += norms * (2 if opts.qk_norm_kind == "layernorm" else 1)  # + phi's biases
        attn += self.num_heads if opts.sinks else 0
        dense = attn + 3 * h * self.intermediate_size + 2 * h  # + the two norms
        total = self.num_layers * dense
        moe = self.moe
        if moe is not None:
            sparse = self.num_layers - len(set(moe.dense_layers) & set(range(self.num_layers)))
            ffn = moe.num_experts * (3 * h * moe.expert_intermediate_size + h)  # + router rows
            ffn += moe.num_experts * (moe.router_bias + moe.expert_bias * (
                2 * moe.expert_intermediate_size + h))  # fmt: skip
            if moe.shared_intermediate_size:
                ffn += 3 * h * moe.shared_intermediate_size + h  # + its gate
            total += sparse * (ffn - 3 * h * self.intermediate_size)
        tables = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return tables + total + h  # + the final norm

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TransformerConfig:
        try:
            return cls(**data)
        except TypeError as exc:
            raise LayerConfigError(f"bad transformer config: {exc}") from None

"""The layer record of the volumetric grid and its kind/activation enums."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from poly.config import MoEConfig
from poly.dtypes import DType, parse_dtype
from poly.errors import LayerConfigError
from poly.rope import RopeScaling
from poly.weights import Generations, WeightStore


class LayerType(IntEnum):
    """Layer kinds; ids follow Loom's code (docs/layers.md), new kinds take new ids."""

    DENSE = 0
    MHA = 1
    SWIGLU = 2
    RMSNORM = 3
    LAYERNORM = 9
    EMBEDDING = 13
    SEQUENTIAL = 17
    RESIDUAL = 18
    MOE = 20  # new kind (Loom's ids stop at 19, Metacognition)
    GELU_MLP = 21  # new kind: the plain (non-gated) MLP with biases

    @property
    def label(self) -> str:
        return _LAYER_LABELS[self]

    def __str__(self) -> str:
        return self.label


_LAYER_LABELS = {
    LayerType.DENSE: "Dense",
    LayerType.MHA: "MultiHeadAttention",
    LayerType.SWIGLU: "SwiGLU",
    LayerType.RMSNORM: "RMSNorm",
    LayerType.LAYERNORM: "LayerNorm",
    LayerType.EMBEDDING: "Embedding",
    LayerType.SEQUENTIAL: "Sequential",
    LayerType.RESIDUAL: "Residual",
    LayerType.MOE: "MoE",
    LayerType.GELU_MLP: "GeluMLP",
}
_LAYER_ALIASES = {
    "DENSE": LayerType.DENSE,
    "MHA": LayerType.MHA,
    "ATTENTION": LayerType.MHA,
    "MULTIHEADATTENTION": LayerType.MHA,
    "SWIGLU": LayerType.SWIGLU,
    "RMSNORM": LayerType.RMSNORM,
    "LAYERNORM": LayerType.LAYERNORM,
    "EMBEDDING": LayerType.EMBEDDING,
    "SEQUENTIAL": LayerType.SEQUENTIAL,
    "RESIDUAL": LayerType.RESIDUAL,
    "MOE": LayerType.MOE,
    "MIXTUREOFEXPERTS": LayerType.MOE,
    "GELUMLP": LayerType.GELU_MLP,
    "GELU_MLP": LayerType.GELU_MLP,
    "MLP": LayerType.GELU_MLP,
}


def add_layer_type(name: str, value: int, label: str | None = None) -> LayerType:
    """A new LayerType member (a layer kind defined outside poly; see poly.nn.register).
    Re-adding the same name and id returns the existing member."""
    key = name.strip().upper()
    existing = LayerType.__members__.get(key)
    if existing is not None and int(existing) == int(value):
        return existing
    if existing is not None or int(value) in LayerType._value2member_map_:
        raise LayerConfigError(f"layer type {name!r} or id {value} is taken")
    member = int.__new__(LayerType, int(value))
    member._name_, member._value_ = key, int(value)
    # enum's own tables, so LayerType(value), LayerType[name] and iteration see the new kind
    LayerType._value2member_map_[int(value)] = member
    LayerType._member_map_[key] = member
    LayerType._member_names_.append(key)
    _LAYER_LABELS[member] = label or name
    _LAYER_ALIASES[key] = member
    return member


def parse_layer_type(value: Any) -> LayerType:
    """Name, alias or id -> LayerType. Unknown is an error (Loom silently falls back to Dense)."""
    if isinstance(value, LayerType):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        try:
            return LayerType(int(value))
        except ValueError:
            raise LayerConfigError(f"unknown layer type id {value}") from None
    if isinstance(value, str) and value.strip().upper() in _LAYER_ALIASES:
        return _LAYER_ALIASES[value.strip().upper()]
    raise LayerConfigError(f"unknown layer type {value!r}")


@dataclass(frozen=True)
class LayerKind:
    """What poly knows about one layer kind (filled by poly.nn, one file per kind).

    complete_dims(layer): fill defaulted dimensions, reject contradictory ones.
    spec(layer): the parameter spec, [(role, shape)] in the order of the flat master.
    forward(layer, x, skip): the reference forward.
    views(layer): the named master views (a record with `as_dict()`); None = carve `spec`.
    matrices: the roles that are matrices (quantized by morph and bakes)."""

    type: LayerType
    forward: Callable[..., Any]
    complete_dims: Callable[[Any], None] = lambda layer: None
    spec: Callable[[Any], list] = lambda layer: []
    views: Callable[[Any], Any] | None = None
    matrices: frozenset = frozenset()


KINDS: dict[LayerType, LayerKind] = {}


def kind_of(layer_type: LayerType) -> LayerKind:
    kind = KINDS.get(layer_type)
    if kind is None:
        raise LayerConfigError(f"no layer kind registered for {layer_type!r}")
    return kind


def param_count(layer: VolumetricLayer) -> int:
    """Values in the layer's flat master: the sum over its parameter spec."""
    return int(sum(math.prod(shape) for _, shape in kind_of(layer.type).spec(layer)))


def _check_common(layer: VolumetricLayer) -> None:
    if not (layer.rms_norm_eps > 0 and layer.rope_freq_base > 0):
        raise LayerConfigError("rms_norm_eps and rope_freq_base must be > 0")


# Attributes whose change does not invalidate cached plans (runtime state, bookkeeping).
_UNPLANNED = frozenset({"state", "z", "y", "x", "l", "allocate", "kv_dtype"})


class Activation(IntEnum):
    LINEAR = -1
    RELU = 0
    SILU = 1
    GELU = 2
    TANH = 3
    SIGMOID = 4
    LEAKY_RELU = 5
    RELU2 = 6
    GELU_ERF = 7  # new: exact GELU, 0.5 x (1 + erf(x / sqrt 2)) (GELU above is the tanh form)


@dataclass(eq=False)
class VolumetricLayer:
    """One cell entry of the grid: kind, dtype, dimensions and a weight store.

    Dimensions not given are filled from the others (head_dim = d_model / num_heads, ...);
    contradictory ones raise LayerConfigError. The weight store is allocated in the offset
    layout of SPEC §1 (the kind's parameter spec, see poly.nn).
    """

    type: LayerType = LayerType.DENSE
    dtype: DType = DType.FLOAT32
    activation: Activation = Activation.LINEAR
    input_height: int = 0
    output_height: int = 0
    d_model: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    query_dim: int = 0
    max_seq_len: int = 2048
    rope_freq_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    # MHA options (poly.nn.mha): the defaults are llama's attention
    sliding_window: int = 0  # keys a query sees, itself included (0: all)
    rotary_dim: int = 0  # RoPE over the first rotary_dim values of each head (0: all)
    rope_interleaved: bool = False  # GPT-J pairs (2i, 2i+1), not (i, i + rotary_dim/2)
    use_rope: bool = True  # False: a NoPE layer
    qk_norm_all: bool = False  # q/k RMSNorm over all heads at once, not per head
    qk_norm_kind: str = "rms"  # q/k norm per head: "rms", "layernorm" (biased), "layernorm_nobias"
    qk_norm_heads: bool = False  # one q/k norm weight per head ([q]/[kv]), not one shared [hd]
    attn_scale: float = 0.0  # logit scale (0: head_dim ** -0.5)
    attn_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: none)
    attn_sinks: bool = False  # a learned per-head logit in the softmax denominator
    vocab_size: int = 0
    embedding_dim: int = 0
    moe: MoEConfig | None = None  # MoE: experts, top-k, gating (poly.nn.moe)
    skip: str | int | None = None  # Residual: "input" (block input) or a sub-layer index
    sequential_layers: list[VolumetricLayer] = field(default_factory=list)
    is_disabled: bool = False
    use_tiling: bool = False
    tile_size: int = 0
    cpu_tile_sizes: dict[DType, int] = field(default_factory=dict)
    gpu_sc_tile_sizes: dict[DType, int] = field(default_factory=dict)
    gpu_mc_tile_sizes: dict[DType, int] = field(default_factory=dict)
    z: int = 0
    y: int = 0
    x: int = 0
    l: int = 0  # noqa: E741 (Loom's name for the in-cell index)
    weights: WeightStore | None = None
    allocate: bool = field(default=True, repr=False)
    state: Any = field(default=None, repr=False)  # runtime state (the MHA KV cache)

    def __post_init__(self) -> None:
        self.type = parse_layer_type(self.type)
        self.dtype = parse_dtype(self.dtype)
        self.activation = Activation(self.activation)
        if self.type == LayerType.SWIGLU and self.activation == Activation.LINEAR:
            self.activation = Activation.SILU
        kind_of(self.type).complete_dims(self)
        _check_common(self)
        count = param_count(self)
        if self.weights is None:
            self.weights = WeightStore(count, allocate=self.allocate)
        elif self.weights.size != count:
            raise LayerConfigError(
                f"weight store holds {self.weights.size} values, {self.type.label} needs {count}"
            )
        object.__setattr__(self, "_built", True)
        Generations.bump()  # once for a new layer, not once per dataclass field

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name not in _UNPLANNED and "_built" in self.__dict__:
            Generations.bump()  # kind, flags, dims or sub-layers changed: plans are stale

    def forward(self, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
        """Run the layer's reference forward; MHA continues its KV cache."""
        return kind_of(self.type).forward(self, x, skip)

    def reset(self) -> None:
        """Clear runtime state (KV cache), recursively."""
        if self.state is not None and hasattr(self.state, "reset"):
            self.state.reset()
        for sub in self.sequential_layers:
            sub.reset()

    def walk(self):
        """Yield this layer and every nested sub-layer, depth first."""
        yield self
        for sub in self.sequential_layers:
            yield from sub.walk()

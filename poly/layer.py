"""The layer record of the volumetric grid and its kind/activation enums."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from poly.config import RopeScaling
from poly.dtypes import DType, parse_dtype
from poly.errors import LayerConfigError
from poly.weights import WeightStore


class LayerType(IntEnum):
    """Layer kinds; ids follow Loom's code (docs/layers.md), new kinds take new ids."""

    DENSE = 0
    MHA = 1
    SWIGLU = 2
    RMSNORM = 3
    EMBEDDING = 13
    SEQUENTIAL = 17
    RESIDUAL = 18

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
    LayerType.EMBEDDING: "Embedding",
    LayerType.SEQUENTIAL: "Sequential",
    LayerType.RESIDUAL: "Residual",
}
_LAYER_ALIASES = {
    "DENSE": LayerType.DENSE,
    "MHA": LayerType.MHA,
    "ATTENTION": LayerType.MHA,
    "MULTIHEADATTENTION": LayerType.MHA,
    "SWIGLU": LayerType.SWIGLU,
    "RMSNORM": LayerType.RMSNORM,
    "EMBEDDING": LayerType.EMBEDDING,
    "SEQUENTIAL": LayerType.SEQUENTIAL,
    "RESIDUAL": LayerType.RESIDUAL,
}


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


class Activation(IntEnum):
    LINEAR = -1
    RELU = 0
    SILU = 1
    GELU = 2
    TANH = 3
    SIGMOID = 4
    LEAKY_RELU = 5
    RELU2 = 6


@dataclass(eq=False)
class VolumetricLayer:
    """One cell entry of the grid: kind, dtype, dimensions and a weight store.

    Dimensions not given are filled from the others (head_dim = d_model / num_heads, ...);
    contradictory ones raise LayerConfigError. The weight store is allocated in the offset
    layout of SPEC §1 (see poly.layout).
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
    vocab_size: int = 0
    embedding_dim: int = 0
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
        from poly import layout  # layout imports this module

        self.type = parse_layer_type(self.type)
        self.dtype = parse_dtype(self.dtype)
        self.activation = Activation(self.activation)
        if self.type == LayerType.SWIGLU and self.activation == Activation.LINEAR:
            self.activation = Activation.SILU
        layout.complete_dims(self)
        if self.weights is None:
            self.weights = WeightStore(layout.param_count(self), allocate=self.allocate)
        elif self.weights.size != layout.param_count(self):
            raise LayerConfigError(
                f"weight store holds {self.weights.size} values, {self.type.label} needs "
                f"{layout.param_count(self)}"
            )

    def forward(self, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
        """Run the layer on float32 activations; MHA continues its KV cache."""
        from poly.layers import dispatch

        return dispatch(self, x, skip)

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

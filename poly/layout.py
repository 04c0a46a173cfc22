"""Offset layouts of each layer kind's flat float32 master (SPEC §1), as named numpy views.

Matrices are row-major [out, in], exactly like HF `nn.Linear.weight`. A user can build a layer,
fill these views and run it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from poly.errors import LayerConfigError

if TYPE_CHECKING:
    from poly.layer import VolumetricLayer


def _mha_dims(layer: VolumetricLayer) -> tuple[int, int, int]:
    return layer.d_model, layer.query_dim, layer.num_kv_heads * layer.head_dim


def complete_dims(layer: VolumetricLayer) -> None:
    """Fill defaulted dimensions in place and reject contradictory ones."""
    from poly.layer import LayerType

    kind = layer.type
    if kind == LayerType.MHA:
        if layer.d_model <= 0 or layer.num_heads <= 0:
            raise LayerConfigError("MHA needs d_model > 0 and num_heads > 0")
        if layer.head_dim <= 0:
            if layer.d_model % layer.num_heads:
                raise LayerConfigError("d_model must be divisible by num_heads without head_dim")
            layer.head_dim = layer.d_model // layer.num_heads
        layer.num_kv_heads = layer.num_kv_heads or layer.num_heads
        if layer.num_heads % layer.num_kv_heads:
            raise LayerConfigError("num_heads must be a multiple of num_kv_heads")
        if layer.head_dim % 2:
            raise LayerConfigError("head_dim must be even for rotary embeddings")
        expected_q = layer.num_heads * layer.head_dim
        if layer.query_dim and layer.query_dim != expected_q:
            raise LayerConfigError(
                f"query_dim {layer.query_dim} != num_heads*head_dim {expected_q}"
            )
        layer.query_dim = expected_q
        if layer.max_seq_len <= 0:
            raise LayerConfigError("max_seq_len must be > 0")
        layer.input_height = layer.output_height = layer.d_model
    elif kind == LayerType.SWIGLU:
        if layer.input_height <= 0 or layer.output_height <= 0:
            raise LayerConfigError("SwiGLU needs input_height (model dim) and output_height")
    elif kind == LayerType.RMSNORM:
        if layer.input_height <= 0:
            raise LayerConfigError("RMSNorm needs input_height")
        layer.output_height = layer.output_height or layer.input_height
    elif kind == LayerType.DENSE:
        if layer.input_height < 0 or layer.output_height < 0:
            raise LayerConfigError("Dense dims must be >= 0")
    elif kind == LayerType.EMBEDDING:
        if layer.vocab_size <= 0 or layer.embedding_dim <= 0:
            raise LayerConfigError("Embedding needs vocab_size and embedding_dim")
    if not (layer.rms_norm_eps > 0 and layer.rope_freq_base > 0):
        raise LayerConfigError("rms_norm_eps and rope_freq_base must be > 0")


def param_count(layer: VolumetricLayer) -> int:
    from poly.layer import LayerType

    kind = layer.type
    if kind == LayerType.MHA:
        d, q, kv = _mha_dims(layer)
        extra = 2 * layer.head_dim if layer.qk_norm else 0
        return 2 * q * d + 2 * kv * d + q + 2 * kv + d + extra
    if kind == LayerType.SWIGLU:
        h, inter = layer.input_height, layer.output_height
        return 3 * h * inter + 2 * inter + h
    if kind == LayerType.RMSNORM:
        return layer.input_height
    if kind == LayerType.DENSE:
        return layer.input_height * layer.output_height
    if kind == LayerType.EMBEDDING:
        return layer.vocab_size * layer.embedding_dim
    return 0


def _carve(master: np.ndarray | None, spec: list[tuple[str, tuple[int, ...]]]) -> dict:
    """Split the flat master into consecutive named views of the given shapes."""
    if master is None:
        raise LayerConfigError("this layer has no float32 master (loaded quantized)")
    views, offset = {}, 0
    for name, shape in spec:
        n = int(np.prod(shape))
        views[name] = master[offset : offset + n].reshape(shape)  # [*shape]
        offset += n
    return views


@dataclass
class MHAViews:
    w_q: np.ndarray  # [q, d]
    w_k: np.ndarray  # [kv, d]
    w_v: np.ndarray  # [kv, d]
    w_o: np.ndarray  # [d, q]
    b_q: np.ndarray
    b_k: np.ndarray
    b_v: np.ndarray
    b_o: np.ndarray
    q_norm: np.ndarray | None = None  # [head_dim]
    k_norm: np.ndarray | None = None  # [head_dim]

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class SwiGLUViews:
    w_gate: np.ndarray  # [I, h]
    w_up: np.ndarray  # [I, h]
    w_down: np.ndarray  # [h, I]
    b_gate: np.ndarray
    b_up: np.ndarray
    b_down: np.ndarray

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class RMSNormViews:
    gamma: np.ndarray  # [h]

    def as_dict(self) -> dict:
        return {"gamma": self.gamma}


@dataclass
class DenseViews:
    w: np.ndarray  # [out, in]

    def as_dict(self) -> dict:
        return {"w": self.w}


def mha(layer: VolumetricLayer) -> MHAViews:
    d, q, kv = _mha_dims(layer)
    spec = [
        ("w_q", (q, d)),
        ("w_k", (kv, d)),
        ("w_v", (kv, d)),
        ("w_o", (d, q)),
        ("b_q", (q,)),
        ("b_k", (kv,)),
        ("b_v", (kv,)),
        ("b_o", (d,)),
    ]
    if layer.qk_norm:
        spec += [("q_norm", (layer.head_dim,)), ("k_norm", (layer.head_dim,))]
    return MHAViews(**_carve(layer.weights.master, spec))


def swiglu(layer: VolumetricLayer) -> SwiGLUViews:
    h, inter = layer.input_height, layer.output_height
    spec = [
        ("w_gate", (inter, h)),
        ("w_up", (inter, h)),
        ("w_down", (h, inter)),
        ("b_gate", (inter,)),
        ("b_up", (inter,)),
        ("b_down", (h,)),
    ]
    return SwiGLUViews(**_carve(layer.weights.master, spec))


def rmsnorm(layer: VolumetricLayer) -> RMSNormViews:
    return RMSNormViews(**_carve(layer.weights.master, [("gamma", (layer.input_height,))]))


def dense(layer: VolumetricLayer) -> DenseViews:
    spec = [("w", (layer.output_height, layer.input_height))]
    return DenseViews(**_carve(layer.weights.master, spec))


def embedding(layer: VolumetricLayer) -> DenseViews:
    return DenseViews(
        **_carve(layer.weights.master, [("w", (layer.vocab_size, layer.embedding_dim))])
    )


def views(layer: VolumetricLayer) -> dict:
    """Named master views of any layer kind ({} for kinds without weights)."""
    from poly.layer import LayerType

    table = {
        LayerType.MHA: mha,
        LayerType.SWIGLU: swiglu,
        LayerType.RMSNORM: rmsnorm,
        LayerType.DENSE: dense,
        LayerType.EMBEDDING: embedding,
    }
    fn = table.get(layer.type)
    return {} if fn is None else fn(layer).as_dict()


def components(layer: VolumetricLayer) -> dict:
    """What the forward pass reads: the active stored version, else the master views."""
    store = layer.weights
    if store.active is not None:
        return store.versions[store.active]
    return views(layer)


# Components that are matrices (quantized by morph and bakes); the rest are float32 vectors.
MATRIX_COMPONENTS = frozenset({"w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down", "w"})

"""The flat float32 master of any layer kind as named numpy views (SPEC §1).

Each kind's parameter spec (poly.nn.<kind>.spec: [(role, shape)] in master order) decides the
offsets; this module carves views from it. Matrices are row-major [out, in], exactly like HF
`nn.Linear.weight`. A user can build a layer, fill these views and run it.
"""

from __future__ import annotations

from poly.layer import VolumetricLayer, kind_of, param_count
from poly.nn.dense import DenseViews
from poly.nn.dense import views as dense
from poly.nn.embedding import views as embedding
from poly.nn.mha import MHAViews
from poly.nn.mha import views as mha
from poly.nn.rmsnorm import RMSNormViews
from poly.nn.rmsnorm import views as rmsnorm
from poly.nn.spec import carve, offsets
from poly.nn.swiglu import SwiGLUViews
from poly.nn.swiglu import views as swiglu

__all__ = [
    "MATRIX_COMPONENTS",
    "DenseViews",
    "MHAViews",
    "RMSNormViews",
    "SwiGLUViews",
    "carve",
    "complete_dims",
    "components",
    "dense",
    "embedding",
    "is_matrix",
    "mha",
    "offsets",
    "param_count",
    "rmsnorm",
    "spec",
    "swiglu",
    "views",
]

# Matrix roles of the built-in kinds (quantized by morph and bakes); the rest are float32 vectors.
MATRIX_COMPONENTS = frozenset({"w_q", "w_k", "w_v", "w_o", "w_gate", "w_up", "w_down", "w"})


def complete_dims(layer: VolumetricLayer) -> None:
    """Fill defaulted dimensions in place and reject contradictory ones."""
    kind_of(layer.type).complete_dims(layer)


def spec(layer: VolumetricLayer) -> list[tuple[str, tuple[int, ...]]]:
    """The layer's parameter spec: [(role, shape)] in the order of its flat master."""
    return kind_of(layer.type).spec(layer)


def is_matrix(layer: VolumetricLayer, role: str) -> bool:
    return role in kind_of(layer.type).matrices


def views(layer: VolumetricLayer) -> dict:
    """Named master views of any layer kind ({} for kinds without weights)."""
    kind = kind_of(layer.type)
    if kind.views is not None:
        return kind.views(layer).as_dict()
    table = kind.spec(layer)
    return carve(layer.weights.master, table) if table else {}


def components(layer: VolumetricLayer) -> dict:
    """What the forward pass reads: the active stored version, else the master views."""
    store = layer.weights
    if store.active is not None:
        return store.versions[store.active]
    return views(layer)

"""The layer-kind registry, keyed by LayerType: one LayerKind record per kind (poly.layer.KINDS).

The built-in kinds register when poly.nn is imported; a kind defined outside poly registers
with `register(LayerKind(add_layer_type("Scale", 100), forward, complete_dims, spec))` and then
builds, runs inside a Sequential and morphs like the built-in ones.
"""

from __future__ import annotations

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import KINDS, LayerKind, LayerType, kind_of


def register(kind: LayerKind, *, replace: bool = False) -> LayerKind:
    """Add a layer kind (replace=True swaps an existing one)."""
    if not isinstance(kind.type, LayerType):
        raise LayerConfigError(f"a layer kind is keyed by a LayerType, got {kind.type!r}")
    if kind.type in KINDS and not replace and KINDS[kind.type] is not kind:
        raise LayerConfigError(f"layer kind {kind.type.label} is registered already")
    KINDS[kind.type] = kind
    return kind


def get(layer_type: LayerType) -> LayerKind:
    return kind_of(layer_type)


def kinds() -> dict[LayerType, LayerKind]:
    return dict(KINDS)


def dispatch(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    """Run `layer`'s reference forward."""
    return kind_of(layer.type).forward(layer, x, skip)

"""Dense: act(W x), W [out, in], no bias (Loom's layout)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import LayerKind, LayerType
from poly.nn.spec import Spec, carve
from poly.ops import ACTIVATIONS, linear


@dataclass
class DenseViews:
    """A dense layer's weight as named views into its master."""

    w: np.ndarray  # [out, in]

    def as_dict(self) -> dict:
        return {"w": self.w}


def complete_dims(layer) -> None:
    if layer.input_height < 0 or layer.output_height < 0:
        raise LayerConfigError("Dense dims must be >= 0")


def spec(layer) -> Spec:
    return [("w", (layer.output_height, layer.input_height))]


def views(layer) -> DenseViews:
    return DenseViews(**carve(layer.weights.master, spec(layer)))


def components(layer) -> dict:
    store = layer.weights
    return store.versions[store.active] if store.active is not None else views(layer).as_dict()


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, layer.input_height)  # [n, in]
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    out = ACTIVATIONS[int(layer.activation)](linear(x2, components(layer)["w"], None, tile))
    return out.reshape(-1) if squeeze else out


KIND = LayerKind(LayerType.DENSE, forward, complete_dims, spec, views, matrices=frozenset({"w"}))

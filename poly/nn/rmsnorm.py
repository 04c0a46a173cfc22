"""RMSNorm: x / sqrt(mean(x^2) + eps) * gamma over the last axis (any leading shape)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import LayerKind, LayerType
from poly.nn.spec import Spec, carve
from poly.ops import rms_norm


@dataclass
class RMSNormViews:
    """An RMSNorm's gamma as a named view into its master."""

    gamma: np.ndarray  # [h]

    def as_dict(self) -> dict:
        return {"gamma": self.gamma}


def complete_dims(layer) -> None:
    if layer.input_height <= 0:
        raise LayerConfigError("RMSNorm needs input_height")
    layer.output_height = layer.output_height or layer.input_height


def spec(layer) -> Spec:
    return [("gamma", (layer.input_height,))]


def views(layer) -> RMSNormViews:
    return RMSNormViews(**carve(layer.weights.master, spec(layer)))


def _find_gamma(layer) -> np.ndarray:
    store = layer.weights
    return store.versions[store.active]["gamma"] if store.active is not None else views(layer).gamma


def gamma(layer) -> np.ndarray:
    """The gamma the forward reads (cached per weight generation)."""
    return layer.weights.plan("rmsnorm", lambda: _find_gamma(layer))


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    return rms_norm(x, gamma(layer), layer.rms_norm_eps)


KIND = LayerKind(LayerType.RMSNORM, forward, complete_dims, spec, views)

"""LayerNorm: (x - mean) / sqrt(var + eps) * gamma + beta over the last axis (any leading shape).

Master layout (offsets in float32 values, h = input_height): gamma @0 [h], beta @h [h]. A norm
without a bias (Cohere) keeps beta at zero; eps is the layer's
`rms_norm_eps` (the one eps field of a VolumetricLayer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import LayerKind, LayerType
from poly.nn.spec import Spec, carve


@dataclass
class LayerNormViews:
    """A LayerNorm's gamma and beta as named views into its master."""

    gamma: np.ndarray  # [h]
    beta: np.ndarray  # [h]

    def as_dict(self) -> dict:
        return {"gamma": self.gamma, "beta": self.beta}


def complete_dims(layer) -> None:
    if layer.input_height <= 0:
        raise LayerConfigError("LayerNorm needs input_height")
    layer.output_height = layer.output_height or layer.input_height
    if layer.output_height != layer.input_height:
        raise LayerConfigError("LayerNorm keeps its width: output_height must equal input_height")


def spec(layer) -> Spec:
    h = layer.input_height
    return [("gamma", (h,)), ("beta", (h,))]


def views(layer) -> LayerNormViews:
    return LayerNormViews(**carve(layer.weights.master, spec(layer)))


def _find(layer) -> tuple[np.ndarray, np.ndarray]:
    store = layer.weights
    comps = store.versions[store.active] if store.active is not None else views(layer).as_dict()
    return comps["gamma"], comps["beta"]


def params(layer) -> tuple[np.ndarray, np.ndarray]:
    """(gamma, beta) the forward reads (cached per weight generation)."""
    return layer.weights.plan("layernorm", lambda: _find(layer))


def layer_norm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, eps: float) -> np.ndarray:
    """The normalisation itself (float64 stays float64, anything else computes in float32);
    the biased variance of the centred values, as torch.nn.functional.layer_norm."""
    dt = np.float64 if getattr(x, "dtype", None) == np.float64 else np.float32
    centred = np.asarray(x, dtype=dt) - np.asarray(x, dtype=dt).mean(-1, keepdims=True)
    var = np.einsum("...i,...i->...", centred, centred)[..., None] / dt(x.shape[-1])
    centred *= dt(1.0) / np.sqrt(var + dt(eps))
    centred *= gamma
    if beta is not None and beta.any():  # a norm without bias: skip the pass
        centred += beta
    return centred


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    gamma, beta = params(layer)
    return layer_norm(x, gamma, beta, layer.rms_norm_eps)


KIND = LayerKind(LayerType.LAYERNORM, forward, complete_dims, spec, views)

"""One module per layer kind; `dispatch` routes a layer to its forward function."""

from __future__ import annotations

import numpy as np

from poly.errors import LayerConfigError
from poly.layers import dense, embedding, mha, residual, rmsnorm, sequential, swiglu

_FORWARD = {
    0: dense.forward,
    1: mha.forward,
    2: swiglu.forward,
    3: rmsnorm.forward,
    13: embedding.forward,
    17: sequential.forward,
    18: residual.forward,
}


def dispatch(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    fn = _FORWARD.get(int(layer.type))
    if fn is None:
        raise LayerConfigError(f"no forward for layer type {layer.type!r}")
    return fn(layer, x, skip)

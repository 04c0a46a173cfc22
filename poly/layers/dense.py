"""Dense: act(W x), W [out, in], no bias (Loom's layout)."""

from __future__ import annotations

import numpy as np

from poly import layout
from poly.ops import ACTIVATIONS, linear


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, layer.input_height)  # [n, in]
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    out = ACTIVATIONS[int(layer.activation)](linear(x2, layout.components(layer)["w"], None, tile))
    return out.reshape(-1) if squeeze else out

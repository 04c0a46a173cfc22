"""SwiGLU feed-forward: down(act(gate(x)) * up(x)), act = SiLU (ReLU2 when asked)."""

from __future__ import annotations

import numpy as np

from poly import layout
from poly.layer import Activation
from poly.ops import ACTIVATIONS, linear


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    h, inter = layer.input_height, layer.output_height
    x2 = x.reshape(-1, h)  # [n, h]
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    store = layer.weights
    if store.active is None and not tile:
        # W_gate and W_up are adjacent in the master: one fused [2I, h] projection.
        gate_up = x2 @ store.master[: 2 * inter * h].reshape(2 * inter, h).T  # [n, 2I]
        gate_up += store.master[3 * h * inter : 3 * h * inter + 2 * inter]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        comps = layout.components(layer)
    else:
        comps = layout.components(layer)
        gate = linear(x2, comps["w_gate"], comps["b_gate"], tile)
        up = linear(x2, comps["w_up"], comps["b_up"], tile)
    act = ACTIVATIONS[int(layer.activation if layer.activation != Activation.LINEAR else 1)]
    hidden = act(gate) * up  # [n, I]
    out = linear(hidden, comps["w_down"], comps["b_down"], tile)  # [n, h]
    return out.reshape(-1) if squeeze else out

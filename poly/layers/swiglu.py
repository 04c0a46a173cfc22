"""SwiGLU feed-forward: down(act(gate(x)) * up(x)), act = SiLU (ReLU2 when asked)."""

from __future__ import annotations

import numpy as np

from poly import ckernels, layout
from poly.kernels import dense_matmul
from poly.layer import Activation
from poly.ops import ACTIVATIONS, linear


def _plan_key(layer) -> tuple:
    store = layer.weights
    if store.active is None:
        return (None, id(store.master))
    return (store.active, *map(id, store.versions[store.active].values()))


class _Plan:
    """Components and the fused gate/up view, derived once per weight version."""

    def __init__(self, layer):
        store = layer.weights
        h, inter = layer.input_height, layer.output_height
        self.key = _plan_key(layer)
        self.comps = layout.components(layer)
        self.w_gu = self.b_gu = None
        if store.active is None:
            # W_gate and W_up (and their biases) are adjacent in the master: one projection.
            self.w_gu = store.master[: 2 * inter * h].reshape(2 * inter, h)  # [2I, h]
            self.b_gu = store.master[3 * h * inter : 3 * h * inter + 2 * inter]
        act = layer.activation if layer.activation != Activation.LINEAR else Activation.SILU
        self.act = ACTIVATIONS[int(act)]
        self.silu = act == Activation.SILU  # the C passes (silu_mul, the fused step) apply


def plan(layer) -> _Plan:
    cached = getattr(layer, "_swiglu_plan", None)
    if cached is None or cached.key != _plan_key(layer):
        cached = _Plan(layer)
        layer._swiglu_plan = cached
    return cached


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    h, inter = layer.input_height, layer.output_height
    x2 = x.reshape(-1, h)  # [n, h]
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    p = plan(layer)
    comps = p.comps
    if p.w_gu is not None and not tile:
        gate_up = dense_matmul(x2, p.w_gu)  # [n, 2I]
        if p.b_gu.any():
            gate_up += p.b_gu
    else:
        gate_up = np.empty((x2.shape[0], 2 * inter), dtype=np.float32)  # [n, 2I]
        gate_up[:, :inter] = linear(x2, comps["w_gate"], comps["b_gate"], tile)
        gate_up[:, inter:] = linear(x2, comps["w_up"], comps["b_up"], tile)
    if p.silu and ckernels.AVAILABLE and gate_up.flags.c_contiguous:
        hidden = np.empty((x2.shape[0], inter), dtype=np.float32)  # [n, I]
        ckernels._c.silu_mul(gate_up, hidden)  # one pass, vectorized exp
    else:
        hidden = p.act(gate_up[:, :inter])
        hidden *= gate_up[:, inter:]  # [n, I]
    out = linear(hidden, comps["w_down"], comps["b_down"], tile)  # [n, h]
    return out.reshape(-1) if squeeze else out

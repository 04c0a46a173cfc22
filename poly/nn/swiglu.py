"""SwiGLU feed-forward: down(act(gate(x)) * up(x)), act = SiLU (ReLU2 when asked). Dimension
rules, parameter spec, named views, plan and reference forward of the SwiGLU layer kind."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import Activation, LayerKind, LayerType
from poly.nn.spec import Spec, carve, span
from poly.ops import ACTIVATIONS, dense_matmul, linear, silu_mul

MATRICES = frozenset({"w_gate", "w_up", "w_down"})


@dataclass
class SwiGLUViews:
    """A SwiGLU MLP's three matrices as named views into its master."""

    w_gate: np.ndarray  # [I, h]
    w_up: np.ndarray  # [I, h]
    w_down: np.ndarray  # [h, I]
    b_gate: np.ndarray
    b_up: np.ndarray
    b_down: np.ndarray

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def complete_dims(layer) -> None:
    if layer.input_height <= 0 or layer.output_height <= 0:
        raise LayerConfigError("SwiGLU needs input_height (model dim) and output_height")


def spec(layer) -> Spec:
    """[(role, shape)] in master order: W_gate, W_up, W_down, then their biases."""
    h, inter = layer.input_height, layer.output_height
    table = [("w_gate", (inter, h)), ("w_up", (inter, h)), ("w_down", (h, inter))]
    return table + [("b_gate", (inter,)), ("b_up", (inter,)), ("b_down", (h,))]


def views(layer) -> SwiGLUViews:
    return SwiGLUViews(**carve(layer.weights.master, spec(layer)))


def components(layer) -> dict:
    store = layer.weights
    return store.versions[store.active] if store.active is not None else views(layer).as_dict()


class Plan:
    """Components and the fused gate/up view, derived once per weight generation."""

    def __init__(self, layer):
        store = layer.weights
        h = layer.input_height
        self.comps = components(layer)
        self.w_gu = self.b_gu = None
        if store.active is None:
            # W_gate and W_up (and their biases) are adjacent in the master: one projection.
            table = spec(layer)
            self.w_gu = span(store.master, table, "w_gate", "w_up").reshape(-1, h)  # [2I, h]
            self.b_gu = span(store.master, table, "b_gate", "b_up")
        act = layer.activation if layer.activation != Activation.LINEAR else Activation.SILU
        self.act = ACTIVATIONS[int(act)]
        self.silu = act == Activation.SILU  # the fused passes (silu_mul, the C step) apply


def plan(layer) -> Plan:
    """The plan of `layer`, cached on its weight store until the weights change."""
    return layer.weights.plan("swiglu", lambda: Plan(layer))


def _gate_up(p: Plan, x2: np.ndarray, inter: int, tile: int) -> np.ndarray:
    """x2 [n, h] -> [n, 2I] (gate | up)."""
    comps = p.comps
    if p.w_gu is not None and not tile:
        if x2.dtype == np.float64:
            return linear(x2, p.w_gu, p.b_gu)  # weights upcast
        gate_up = dense_matmul(x2, p.w_gu)  # [n, 2I]
        if p.b_gu.any():
            gate_up += p.b_gu
        return gate_up
    gate_up = np.empty((x2.shape[0], 2 * inter), dtype=x2.dtype)  # [n, 2I]
    gate_up[:, :inter] = linear(x2, comps["w_gate"], comps["b_gate"], tile)
    gate_up[:, inter:] = linear(x2, comps["w_up"], comps["b_up"], tile)
    return gate_up


def _gated(p: Plan, gate_up: np.ndarray, inter: int) -> np.ndarray:
    """act(gate) * up from gate_up [n, 2I] -> [n, I]."""
    if p.silu and gate_up.dtype == np.float32 and gate_up.flags.c_contiguous:
        return silu_mul(gate_up, np.empty((gate_up.shape[0], inter), dtype=np.float32))
    hidden = p.act(gate_up[:, :inter])
    hidden *= gate_up[:, inter:]
    return hidden


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    h, inter = layer.input_height, layer.output_height
    x2 = x.reshape(-1, h)  # [n, h]
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    p = plan(layer)
    if p.silu and p.w_gu is None and not tile and x2.dtype == np.float32:
        # gate and up apart (GGUF): no [n, 2I] copy of both
        gate = np.ascontiguousarray(linear(x2, p.comps["w_gate"], p.comps["b_gate"]), np.float32)
        up = np.ascontiguousarray(linear(x2, p.comps["w_up"], p.comps["b_up"]), np.float32)
        hidden = silu_mul(gate, np.empty((x2.shape[0], inter), dtype=np.float32), up)  # [n, I]
    else:
        hidden = _gated(p, _gate_up(p, x2, inter, tile), inter)  # [n, I]
    out = linear(hidden, p.comps["w_down"], p.comps["b_down"], tile)  # [n, h]
    return out.reshape(-1) if squeeze else out


KIND = LayerKind(LayerType.SWIGLU, forward, complete_dims, spec, views, matrices=MATRICES)

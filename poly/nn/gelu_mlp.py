"""The plain (non-gated) MLP: down(act(up(x) + b_up)) + b_down, act one of Activation GELU_ERF
(exact GELU, HF "gelu"; the default), GELU (the tanh form, HF "gelu_new" / "gelu_pytorch_tanh"),
RELU2 (relu squared) or any other Activation. StarCoder2, GPT-NeoX and Phi-2 use it.

Master layout (offsets in float32 values, h = input_height, I = output_height): W_up @0 [I, h],
W_down @I*h [h, I], b_up @2*I*h [I], b_down @2*I*h + I [h]. Matrices are [out, in] like
`nn.Linear.weight`; the biases stay float32 when morph quantizes the matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from poly.errors import LayerConfigError
from poly.layer import Activation, LayerKind, LayerType
from poly.nn.spec import Spec, carve
from poly.ops import ACTIVATIONS, linear

MATRICES = frozenset({"w_up", "w_down"})

# HF `hidden_act` names -> the Activation the layer runs (transformers.activations.ACT2FN).
HF_ACTIVATIONS = {
    "gelu": Activation.GELU_ERF,
    "gelu_new": Activation.GELU,
    "gelu_pytorch_tanh": Activation.GELU,
    "relu": Activation.RELU,
    "relu2": Activation.RELU2,
    "silu": Activation.SILU,
}


@dataclass
class GeluMLPViews:
    """A GELU MLP's matrices and biases as named views into its master."""

    w_up: np.ndarray  # [I, h]
    w_down: np.ndarray  # [h, I]
    b_up: np.ndarray  # [I]
    b_down: np.ndarray  # [h]

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def activation_of(hidden_act: str) -> Activation:
    """The Activation for an HF `hidden_act` name; LayerConfigError naming it when unknown."""
    act = HF_ACTIVATIONS.get(hidden_act)
    if act is None:
        known = ", ".join(HF_ACTIVATIONS)
        raise LayerConfigError(f"hidden_act {hidden_act!r} is not supported ({known})")
    return act


def complete_dims(layer) -> None:
    if layer.input_height <= 0 or layer.output_height <= 0:
        raise LayerConfigError("GeluMLP needs input_height (model dim) and output_height")
    if layer.activation == Activation.LINEAR:
        layer.activation = Activation.GELU_ERF


def spec(layer) -> Spec:
    """[(role, shape)] in master order: W_up, W_down, then their biases."""
    h, inter = layer.input_height, layer.output_height
    return [("w_up", (inter, h)), ("w_down", (h, inter)), ("b_up", (inter,)), ("b_down", (h,))]


def views(layer) -> GeluMLPViews:
    return GeluMLPViews(**carve(layer.weights.master, spec(layer)))


def components(layer) -> dict:
    store = layer.weights
    return store.versions[store.active] if store.active is not None else views(layer).as_dict()


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    squeeze = x.ndim == 1
    x2 = x.reshape(-1, layer.input_height)  # [n, h]
    tile = layer.tile_size if layer.use_tiling and layer.tile_size > 0 else 0
    comps = layer.weights.plan("gelu_mlp", lambda: components(layer))
    hidden = linear(x2, comps["w_up"], comps["b_up"], tile)  # [n, I]
    hidden = ACTIVATIONS[int(layer.activation)](hidden).astype(x2.dtype, copy=False)
    out = linear(hidden, comps["w_down"], comps["b_down"], tile)  # [n, h]
    return out.reshape(-1) if squeeze else out


KIND = LayerKind(LayerType.GELU_MLP, forward, complete_dims, spec, views, matrices=MATRICES)

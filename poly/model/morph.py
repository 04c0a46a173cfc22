"""Convert layers to another dtype. Matrices are encoded (per-row scales), vectors (biases,
gammas) pass through the codec and are kept as float32 decoded values, so a morphed layer runs
from its stored representation."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from poly.dtypes import DType, decode, encode, parse_dtype
from poly.layer import LayerType, VolumetricLayer
from poly.nn import layout
from poly.quant.qtensor import CodedMatrix

KEEP_FLOAT32 = (LayerType.RMSNORM, LayerType.MOE)  # MoE: its own master is the router


def morph_layer(layer: VolumetricLayer, dtype, *, recursive: bool = True) -> VolumetricLayer:
    """Re-encode `layer` (and its sub-layers) in `dtype`; float32 switches back to the master."""
    dt = parse_dtype(dtype)
    if recursive:
        for sub in layer.sequential_layers:
            morph_layer(sub, dt)
    store = layer.weights
    if layer.type == LayerType.MOE:  # the experts were morphed above; the router stays float32
        return layer
    if store is None or store.size == 0:
        layer.dtype = dt
        return layer
    if dt == DType.FLOAT32:
        store.activate(None)
        layer.dtype = dt
        return layer
    comps = {}
    for name, view in layout.views(layer).items():
        if view is None:
            comps[name] = None
        elif layout.is_matrix(layer, name):
            comps[name] = CodedMatrix.encode(np.ascontiguousarray(view), dt)
        else:
            comps[name] = decode(encode(np.asarray(view, dtype=np.float32), dt)).astype(np.float32)
    store.set_version(dt.label, comps, activate=True)
    layer.dtype = dt
    return layer


def morph_network(net, dtype, *, keep: Iterable[LayerType] = KEEP_FLOAT32) -> None:
    """Morph every top-level layer of a network (recursively), norms kept float32 by default."""
    keep = tuple(keep)
    for layer in net.layers:
        for sub in layer.walk():
            if sub.type in keep or sub.type == LayerType.SEQUENTIAL:
                continue
            morph_layer(sub, dtype, recursive=False)

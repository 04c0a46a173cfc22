"""poly: build and run transformer language models on a volumetric layer grid."""

import gc as _gc

# the one place the version is written: pyproject.toml reads it (distribution polyloom)
__version__ = "0.3.0"

_collecting = _gc.isenabled()
_gc.disable()  # the imports make thousands of long-lived objects: collecting them is waste
try:
    from poly import openblas  # noqa: F401, I001  (first: OpenBLAS reads its settings as numpy loads)

    # nn registers the layer kinds; runtime and text fill the model's hooks (poly.model.hooks)
    from poly import nn, runtime, text  # noqa: F401
    from poly.config import TransformerConfig
    from poly.dtypes import DType, parse_dtype
    from poly.errors import ContextOverflowError, PolyError
    from poly.layer import Activation, LayerType, VolumetricLayer, parse_layer_type
    from poly.model import Transformer, param_shapes
    from poly.model.morph import morph_layer, morph_network
    from poly.network import VolumetricNetwork
    from poly.nn import layout
    from poly.rope import RopeScaling
    from poly.weights import WeightStore
finally:
    if _collecting:
        _gc.enable()

__all__ = [
    "Activation",
    "ContextOverflowError",
    "DType",
    "LayerType",
    "PolyError",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "VolumetricLayer",
    "VolumetricNetwork",
    "WeightStore",
    "layout",
    "morph_layer",
    "morph_network",
    "nn",
    "param_shapes",
    "parse_dtype",
    "parse_layer_type",
]

"""poly: build and run transformer language models on a volumetric layer grid."""

import os as _os

# OpenBLAS worker threads busy-wait 2**28 cycles after each call. A decode step right after a
# BLAS prefill runs on the OpenMP threads of poly._ckernels, and was measured 2x slower for
# its first tokens while they spin; 2**12 cycles keeps prefill within noise
# (docs/performance.md). Read when numpy loads: no effect if it is loaded already, and an
# explicit setting wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")

from poly import layout
from poly.config import RopeScaling, TransformerConfig
from poly.dtypes import DType, parse_dtype
from poly.errors import ContextOverflowError, PolyError
from poly.layer import Activation, LayerType, VolumetricLayer, parse_layer_type
from poly.morph import morph_layer, morph_network
from poly.network import VolumetricNetwork
from poly.transformer import Transformer
from poly.weights import WeightStore

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
    "parse_dtype",
    "parse_layer_type",
]

"""poly: build and run transformer language models on a volumetric layer grid."""

import os as _os

# OpenBLAS worker threads busy-wait 2**28 cycles (~0.1 s) after each call: the decode steps
# right after a BLAS prefill (on poly._ckernels' OpenMP threads) ran 2x slower while they
# spun. 2**24 cycles (a few ms) outlasts the gaps between a prefill's GEMMs, so prefill speed
# is unchanged (docs/performance.md). Read when numpy loads: no effect if numpy is loaded
# already, and an explicit setting wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "24")

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

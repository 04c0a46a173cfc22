"""poly: build and run transformer language models on a volumetric layer grid."""

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

"""The model layer: the decoder block and the Transformer (build, slot names, reference
forward). Never imports poly.runtime or poly.text: they fill poly.model.hooks."""

from poly.model.block import build_block, param_shapes
from poly.model.transformer import Transformer

__all__ = ["Transformer", "build_block", "param_shapes"]

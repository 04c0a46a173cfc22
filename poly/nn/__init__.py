"""Layer kinds: one module per kind (dimension rules, parameter spec, named views, plan,
reference forward), registered by LayerType in poly.layer.KINDS.

    poly.nn.register(kind)      add a kind (see poly.nn.registry)
    poly.nn.spec(layer)         [(role, shape)] in the order of the layer's flat master
    poly.nn.param_count(layer)  values in that master
"""

from poly.layer import LayerKind, add_layer_type, param_count
from poly.nn import (
    dense,
    embedding,
    gelu_mlp,
    layernorm,
    mha,
    moe,
    residual,
    rmsnorm,
    sequential,
    swiglu,
)
from poly.nn.layout import components, spec, views
from poly.nn.registry import dispatch, get, kinds, register

for _module in (
    dense,
    embedding,
    gelu_mlp,
    layernorm,
    mha,
    moe,
    residual,
    rmsnorm,
    sequential,
    swiglu,
):
    register(_module.KIND, replace=True)

__all__ = [
    "LayerKind",
    "add_layer_type",
    "components",
    "dispatch",
    "get",
    "kinds",
    "param_count",
    "register",
    "spec",
    "views",
]

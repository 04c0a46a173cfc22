"""The LayerNorm and plain-MLP layer kinds (and the exact GELU they need) against torch's own
functions: torch.nn.functional.layer_norm, F.gelu (exact and tanh), torch.erf, nn.Linear."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import poly.nn
from poly import DType, LayerType, VolumetricLayer, morph_layer
from poly.errors import LayerConfigError
from poly.layer import Activation, parse_layer_type
from poly.nn import gelu_mlp
from poly.nn.spec import offsets
from poly.ops import erf

RNG = np.random.default_rng(58)


def max_rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _layernorm(h, eps, bias=True):
    layer = VolumetricLayer(type=LayerType.LAYERNORM, input_height=h, rms_norm_eps=eps)
    v = poly.nn.views(layer)
    v["gamma"][...] = RNG.standard_normal(h) + 1.0
    if bias:
        v["beta"][...] = RNG.standard_normal(h)
    return layer, torch.from_numpy(v["gamma"].copy()), torch.from_numpy(v["beta"].copy())


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_matches_torch_float32_and_float64(bias):
    h, eps = 37, 1e-5
    layer, gamma, beta = _layernorm(h, eps, bias)
    x = (RNG.standard_normal((2, 5, h)) * 3 + 0.7).astype(np.float32)  # a mean to remove
    ref = F.layer_norm(torch.from_numpy(x), (h,), gamma, beta if bias else None, eps).numpy()
    out = layer.forward(x)
    assert out.dtype == np.float32 and out.shape == x.shape and max_rel(out, ref) < 2e-6
    x64 = x.astype(np.float64)
    ref64 = F.layer_norm(torch.from_numpy(x64), (h,), gamma.double(), beta.double(), eps).numpy()
    out64 = layer.forward(x64)
    assert out64.dtype == np.float64 and max_rel(out64, ref64) < 1e-13


def test_layernorm_bias_written_after_a_forward_is_used():
    """Biases filled in place after a first run (a loader filling views) are read."""
    layer, gamma, _ = _layernorm(16, 1e-6, bias=False)
    x = RNG.standard_normal((3, 16)).astype(np.float32)
    layer.forward(x)
    beta = RNG.standard_normal(16).astype(np.float32)
    poly.nn.views(layer)["beta"][...] = beta
    ref = F.layer_norm(torch.from_numpy(x), (16,), gamma, torch.from_numpy(beta), 1e-6).numpy()
    assert max_rel(layer.forward(x), ref) < 2e-6


def test_layernorm_kind_by_loom_name_and_id():
    assert parse_layer_type("LayerNorm") is LayerType.LAYERNORM is parse_layer_type(9)
    layer = VolumetricLayer(type="layernorm", input_height=8)
    assert dict(poly.nn.spec(layer)) == {"gamma": (8,), "beta": (8,)}
    with pytest.raises(LayerConfigError, match="LayerNorm"):
        VolumetricLayer(type=LayerType.LAYERNORM, input_height=8, output_height=4)


def test_erf_matches_math_and_torch():
    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, 1e-300, -1e-8, 5.999, 6.0, 30.0]])
    ref = np.array([math.erf(v) for v in x])
    assert np.max(np.abs(erf(x) - ref)) < 1e-14
    assert np.max(np.abs(erf(x) - torch.erf(torch.from_numpy(x)).numpy())) < 1e-14
    out = erf(np.array([np.inf, -np.inf, np.nan]))
    assert out[0] == 1.0 and out[1] == -1.0 and np.isnan(out[2])


def _mlp(h, inter, act):
    layer = VolumetricLayer(
        type=LayerType.GELU_MLP, input_height=h, output_height=inter, activation=act
    )
    up, down = torch.nn.Linear(h, inter), torch.nn.Linear(inter, h)
    v = gelu_mlp.views(layer)
    for w, b, lin in ((v.w_up, v.b_up, up), (v.w_down, v.b_down, down)):
        w[...] = lin.weight.detach().numpy()
        b[...] = RNG.standard_normal(b.shape) * 0.5  # biases well away from zero
        lin.bias.data = torch.from_numpy(b.copy())
    return layer, up, down


TORCH_ACTS = {
    Activation.GELU_ERF: lambda t: F.gelu(t),
    Activation.GELU: lambda t: F.gelu(t, approximate="tanh"),
    Activation.RELU2: lambda t: torch.relu(t) ** 2,
}


@pytest.mark.parametrize("act", list(TORCH_ACTS))
def test_gelu_mlp_matches_torch(act):
    h, inter = 24, 70
    layer, up, down = _mlp(h, inter, act)
    x = (RNG.standard_normal((7, h)) * 2).astype(np.float32)
    with torch.no_grad():
        ref = down(TORCH_ACTS[act](up(torch.from_numpy(x)))).numpy()
        ref64 = down.double()(TORCH_ACTS[act](up.double()(torch.from_numpy(x).double()))).numpy()
    out = layer.forward(x)
    assert out.dtype == np.float32 and out.shape == (7, h) and max_rel(out, ref) < 1e-5
    out64 = layer.forward(x.astype(np.float64))
    assert out64.dtype == np.float64 and max_rel(out64, ref64) < 1e-12
    one = layer.forward(x[3])
    assert one.shape == (h,) and max_rel(one, ref[3]) < 1e-5


def test_gelu_mlp_layout_and_default_activation():
    layer = VolumetricLayer(type="GeluMLP", input_height=6, output_height=10)
    assert layer.activation == Activation.GELU_ERF  # HF's "gelu" is the exact form
    assert offsets(poly.nn.spec(layer)) == {
        "w_up": (0, 60), "w_down": (60, 120), "b_up": (120, 130), "b_down": (130, 136),
    }  # fmt: skip
    assert poly.nn.get(LayerType.GELU_MLP).matrices == {"w_up", "w_down"}


def test_gelu_mlp_q8_morph_keeps_float32_biases():
    layer, up, down = _mlp(32, 64, Activation.GELU)
    x = RNG.standard_normal((4, 32)).astype(np.float32)
    with torch.no_grad():
        ref = down(F.gelu(up(torch.from_numpy(x)), approximate="tanh")).numpy()
    morph_layer(layer, DType.INT8)
    comps = poly.nn.components(layer)
    assert comps["b_up"].dtype == np.float32 and not isinstance(comps["w_up"], np.ndarray)
    assert max_rel(layer.forward(x), ref) < 2e-2


def test_hf_activation_names():
    assert gelu_mlp.activation_of("gelu") == Activation.GELU_ERF
    assert gelu_mlp.activation_of("gelu_pytorch_tanh") == Activation.GELU
    assert gelu_mlp.activation_of("gelu_new") == Activation.GELU
    with pytest.raises(LayerConfigError, match="'gelu_fast'"):
        gelu_mlp.activation_of("gelu_fast")

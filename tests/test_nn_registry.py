"""poly.nn: kinds registered by LayerType, one added from outside the package, the role -> shape
table derived from the specs, and the plan cache keyed on weight generations."""

from __future__ import annotations

import numpy as np
import pytest

import poly.nn
from poly import DType, LayerType, TransformerConfig, VolumetricLayer, morph_layer, param_shapes
from poly.errors import LayerConfigError
from poly.nn import mha
from poly.nn.spec import carve
from tests.hf_fixtures import make_tiny_checkpoint
from tests.tiny_model import random_transformer

# --- a kind defined here, outside poly: y = act(x * scale + shift), scale/shift [h] + W [h, h]


def _scale_dims(layer) -> None:
    if layer.input_height <= 0:
        raise LayerConfigError("Scale needs input_height")
    layer.output_height = layer.input_height


def _scale_spec(layer):
    h = layer.input_height
    return [("w", (h, h)), ("scale", (h,)), ("shift", (h,))]


def _scale_forward(layer, x, skip=None):
    comps = poly.nn.components(layer)
    from poly.ops import linear

    return linear(x * comps["scale"] + comps["shift"], comps["w"])


SCALE = poly.nn.add_layer_type("Scale", 100)
poly.nn.register(
    poly.nn.LayerKind(SCALE, _scale_forward, _scale_dims, _scale_spec, matrices=frozenset({"w"})),
    replace=True,
)


def test_a_kind_registered_from_outside_runs_in_a_sequential_and_morphs():
    h = 16
    scale = VolumetricLayer(type="Scale", input_height=h)
    assert scale.type is SCALE and scale.weights.size == h * h + 2 * h
    v = poly.nn.views(scale)
    rng = np.random.default_rng(0)
    for name in v:
        v[name][...] = rng.normal(size=v[name].shape)
    norm = VolumetricLayer(type=LayerType.RMSNORM, input_height=h)
    poly.nn.views(norm)["gamma"][...] = 1.0
    block = VolumetricLayer(
        type=LayerType.SEQUENTIAL,
        sequential_layers=[norm, scale, VolumetricLayer(type=LayerType.RESIDUAL, skip="input")],
    )
    x = rng.normal(size=(3, h)).astype(np.float32)
    xn = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)
    want = (xn * v["scale"] + v["shift"]) @ v["w"].T.astype(np.float64) + x
    np.testing.assert_allclose(block.forward(x), want, rtol=1e-4, atol=1e-4)
    morph_layer(scale, DType.INT8)
    comps = scale.weights.versions[scale.weights.active]
    assert comps["w"].scheme == "int8" and isinstance(comps["scale"], np.ndarray)
    np.testing.assert_allclose(block.forward(x), want, rtol=0, atol=0.05 * np.abs(want).max())


def test_registry_is_keyed_by_layer_type():
    kinds = poly.nn.kinds()
    assert all(isinstance(k, LayerType) for k in kinds)
    assert poly.nn.get(LayerType.MHA) is mha.KIND
    with pytest.raises(LayerConfigError):
        poly.nn.register(poly.nn.LayerKind(LayerType.MHA, _scale_forward))  # taken


def test_param_shapes_match_transformers_state_dict(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(tmp_path / "q3", "qwen3")  # qk-norm, head_dim != hidden/heads
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    import entity

    shapes = param_shapes(entity.load(path).config)
    pre = "model.layers.0."
    assert shapes["attn"]["w_q"] == sd[pre + "self_attn.q_proj.weight"]
    assert shapes["attn"]["w_k"] == sd[pre + "self_attn.k_proj.weight"]
    assert shapes["attn"]["w_o"] == sd[pre + "self_attn.o_proj.weight"]
    assert shapes["attn"]["q_norm"] == sd[pre + "self_attn.q_norm.weight"]
    assert shapes["mlp"]["w_gate"] == sd[pre + "mlp.gate_proj.weight"]
    assert shapes["mlp"]["w_down"] == sd[pre + "mlp.down_proj.weight"]
    assert shapes["attn_norm"]["gamma"] == sd[pre + "input_layernorm.weight"]
    assert shapes["embeddings"]["w"] == sd["model.embed_tokens.weight"]


def test_plans_follow_weight_generations():
    cfg = TransformerConfig(
        vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
        num_kv_heads=2, max_seq_len=16,
    )  # fmt: skip
    tf = random_transformer(cfg)
    attn = tf.attn(0)
    p1 = mha.plan(attn)
    assert mha.plan(attn) is p1  # unchanged weights: the cached plan
    gen = attn.weights.generation
    morph_layer(attn, DType.INT8)
    assert attn.weights.generation != gen
    p2 = mha.plan(attn)
    assert p2 is not p1 and p2.w_qkv is None
    version = attn.weights.versions[attn.weights.active]
    version["w_o"] = version["w_o"]  # a component swapped in place counts too
    assert mha.plan(attn) is not p2


def test_spec_offsets_carve_the_master():
    layer = VolumetricLayer(type=LayerType.SWIGLU, input_height=4, output_height=6)
    spec = poly.nn.spec(layer)
    assert [r for r, _ in spec] == ["w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down"]
    views = carve(layer.weights.master, spec)
    assert sum(v.size for v in views.values()) == layer.weights.size == poly.nn.param_count(layer)

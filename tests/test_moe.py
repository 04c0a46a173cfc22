"""The MoE layer kind (poly.nn.moe) against transformers' own sparse MoE blocks (Qwen2-MoE with a
shared expert, Qwen3-MoE / Mixtral routing), including the router edge cases of issue #14:
ties in the top-k, k = E, E = 1 and a token whose router logits are all equal."""

from __future__ import annotations

import numpy as np
import pytest

from poly.config import MoEConfig
from poly.errors import LayerConfigError
from poly.layer import LayerType, VolumetricLayer
from poly.model.morph import morph_layer
from poly.nn import layout, moe

D, WIDTH, SHARED = 16, 12, 10


def _hf_block(n_exp: int, k: int, norm: bool, shared: bool, seed: int):
    """A transformers sparse-MoE block with random weights (Qwen2-MoE when `shared`)."""
    import torch
    import transformers
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    kw = dict(hidden_size=D, moe_intermediate_size=WIDTH, num_experts=n_exp,
              num_experts_per_tok=k, norm_topk_prob=norm)  # fmt: skip
    torch.manual_seed(seed)
    if shared:
        cfg = transformers.Qwen2MoeConfig(shared_expert_intermediate_size=SHARED, **kw)
        block = Qwen2MoeSparseMoeBlock(cfg)
    else:
        block = Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(**kw))
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    return block.eval()


def _ours_from(block, n_exp: int, k: int, norm: bool, shared: bool) -> VolumetricLayer:
    cfg = MoEConfig(n_exp, k, WIDTH, "softmax", norm, SHARED if shared else 0)
    layer = VolumetricLayer(type=LayerType.MOE, input_height=D, moe=cfg)
    v = moe.views(layer)
    v.router[...] = block.gate.weight.detach().numpy()
    gu = block.experts.gate_up_proj.detach().numpy()  # [E, 2I, d]
    down = block.experts.down_proj.detach().numpy()  # [E, d, I]
    for e, expert in enumerate(moe.experts(layer)):
        sw = layout.swiglu(expert)
        sw.w_gate[...], sw.w_up[...], sw.w_down[...] = gu[e, :WIDTH], gu[e, WIDTH:], down[e]
    if shared:
        v.shared_gate[...] = block.shared_expert_gate.weight.detach().numpy()
        sw = layout.swiglu(moe.shared_expert(layer))
        sw.w_gate[...] = block.shared_expert.gate_proj.weight.detach().numpy()
        sw.w_up[...] = block.shared_expert.up_proj.weight.detach().numpy()
        sw.w_down[...] = block.shared_expert.down_proj.weight.detach().numpy()
    return layer


def _hf_out(block, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return block(torch.from_numpy(x)[None]).detach().numpy()[0]


def _pair(n_exp, k, norm, shared, seed=0):
    block = _hf_block(n_exp, k, norm, shared, seed)
    return block, _ours_from(block, n_exp, k, norm, shared)


@pytest.mark.parametrize(
    "n_exp,k,norm,shared",
    [
        (8, 2, True, False),
        (8, 2, False, True),
        (6, 3, False, False),
        (5, 5, True, True),
        (1, 1, True, False),
        (1, 1, False, True),
        (4, 1, False, False),
    ],  # fmt: skip
)
def test_moe_layer_matches_transformers(n_exp, k, norm, shared):
    block, ours = _pair(n_exp, k, norm, shared)
    x = np.random.default_rng(1).standard_normal((9, D)).astype(np.float32)
    want = _hf_out(block, x)
    np.testing.assert_allclose(ours.forward(x), want, atol=1e-5, rtol=0)
    rows = np.stack([ours.forward(r) for r in x])  # decode: one token at a time
    np.testing.assert_allclose(rows, want, atol=1e-5, rtol=0)


def _tie_experts(block, ours, group: list[int]) -> None:
    """Give the experts in `group` the router row and weights of the first one (exact ties)."""
    import torch

    with torch.no_grad():
        for e in group[1:]:
            block.gate.weight[e] = block.gate.weight[group[0]]
            block.experts.gate_up_proj[e] = block.experts.gate_up_proj[group[0]]
            block.experts.down_proj[e] = block.experts.down_proj[group[0]]
    fresh = _ours_from(block, ours.moe.num_experts, ours.moe.top_k, ours.moe.norm_topk_prob,
                       ours.moe.shared_intermediate_size > 0)  # fmt: skip
    ours.sequential_layers, ours.weights = fresh.sequential_layers, fresh.weights


def test_ties_across_the_top_k_boundary_pick_the_lower_id():
    # torch.topk's order among exact ties is unspecified (CPU: 4 equal scores, k=2 -> ids 2, 3),
    # so a tie across the boundary is compared with tied experts that are identical.
    block, ours = _pair(6, 2, False, True, seed=3)
    _tie_experts(block, ours, [1, 3, 4])
    x = np.random.default_rng(2).standard_normal((7, D)).astype(np.float32)
    np.testing.assert_allclose(ours.forward(x), _hf_out(block, x), atol=1e-5, rtol=0)
    idx, _ = moe.route(np.array([[0.0, 2.0, 1.0, 2.0, 2.0, 0.5]]), 2)
    assert idx.tolist() == [[1, 3]]  # stable: lower id first among the tied


def test_ties_inside_the_top_k_match_transformers_exactly():
    block, ours = _pair(5, 3, True, False, seed=4)
    import torch

    with torch.no_grad():  # experts 0 and 2 share a router row, so their scores tie exactly
        block.gate.weight[2] = block.gate.weight[0] * 1.0
        block.gate.weight[0] *= 4.0
        block.gate.weight[2] *= 4.0
    moe.views(ours).router[...] = block.gate.weight.detach().numpy()
    x = np.random.default_rng(5).standard_normal((6, D)).astype(np.float32)
    np.testing.assert_allclose(ours.forward(x), _hf_out(block, x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_all_equal_router_logits(k):
    block, ours = _pair(4, k, True, True, seed=6)
    import torch

    with torch.no_grad():
        block.gate.weight.zero_()  # every token: logits all 0
    moe.views(ours).router[...] = 0.0
    if k < 4:
        _tie_experts(block, ours, [0, 1, 2, 3])
        moe.views(ours).router[...] = 0.0
    x = np.random.default_rng(7).standard_normal((5, D)).astype(np.float32)
    np.testing.assert_allclose(ours.forward(x), _hf_out(block, x), atol=1e-5, rtol=0)
    idx, w = moe.route(np.zeros((1, 4), np.float32), k)
    assert idx.tolist() == [list(range(k))] and np.allclose(w, 1.0 / k)


def test_sigmoid_gating_and_route_shapes():
    logits = np.array([[0.0, 1.0, -1.0]], np.float32)
    idx, w = moe.route(logits, 2, "sigmoid", norm_topk_prob=False)
    assert idx.tolist() == [[1, 0]]
    np.testing.assert_allclose(w, [[1 / (1 + np.exp(-1.0)), 0.5]], rtol=1e-6)


def test_moe_inside_a_sequential_residual_block():
    _, layer = _pair(4, 2, True, False, seed=8)
    norm = VolumetricLayer(type=LayerType.RMSNORM, input_height=D)
    layout.rmsnorm(norm).gamma[...] = 1.5
    block = VolumetricLayer(
        type=LayerType.SEQUENTIAL,
        sequential_layers=[norm, layer, VolumetricLayer(type=LayerType.RESIDUAL, skip="input")],
    )
    x = np.random.default_rng(9).standard_normal((3, D)).astype(np.float32)
    normed = x / np.sqrt((x**2).mean(-1, keepdims=True) + norm.rms_norm_eps) * 1.5
    np.testing.assert_allclose(block.forward(x), x + layer.forward(normed), atol=1e-5, rtol=1e-5)


def test_morph_quantizes_experts_and_keeps_the_router_float32():
    _, layer = _pair(4, 2, True, True, seed=10)
    x = np.random.default_rng(11).standard_normal((4, D)).astype(np.float32)
    ref = layer.forward(x)
    router = moe.views(layer).router.copy()
    morph_layer(layer, "int8")
    assert all(e.weights.active == "int8" for e in layer.sequential_layers)
    assert layer.weights.active is None and np.array_equal(moe.views(layer).router, router)
    np.testing.assert_allclose(layer.forward(x), ref, atol=0.05 * np.abs(ref).max())


def test_bad_moe_records_are_typed_errors():
    with pytest.raises(LayerConfigError, match="top_k 5 exceeds num_experts 4"):
        MoEConfig(4, 5, 8)
    with pytest.raises(LayerConfigError, match="gating"):
        MoEConfig(4, 2, 8, gating="relu")
    with pytest.raises(LayerConfigError, match="needs a moe config"):
        VolumetricLayer(type=LayerType.MOE, input_height=8)
    with pytest.raises(LayerConfigError, match="expert 1 must be a SwiGLU"):
        VolumetricLayer(
            type="moe", input_height=8, moe=MoEConfig(2, 1, 4),
            sequential_layers=[VolumetricLayer(type="swiglu", input_height=8, output_height=4),
                               VolumetricLayer(type="swiglu", input_height=8, output_height=5)],
        )  # fmt: skip

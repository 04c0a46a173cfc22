"""The MoE options of issue 58 (poly/nn/moe.py, poly/quant/ggml.py) against references we did not
write: GPT-OSS's MLP (router bias, softmax over the top-k logits, expert biases, the clamped
SwiGLU with interleaved gate/up columns) and GraniteMoE's MoE against transformers' own modules;
MXFP4 dequantization against gguf-py (GGUF blocks) and transformers' integrations/mxfp4.py (the
checkpoint's ``*_blocks``/``*_scales``)."""

from __future__ import annotations

import numpy as np
import pytest

from poly.config import MoEConfig
from poly.errors import LayerConfigError, WeightMappingError
from poly.layer import LayerType, VolumetricLayer
from poly.nn import layout, moe
from poly.quant.ggml import QUANT_SIZES, GGMLType, dequantize_mxfp4, dequantize_mxfp4_hf

D, WIDTH = 16, 12


def _gpt_oss_mlp(n_exp: int, k: int, seed: int, scale: float):
    import torch
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=WIDTH,
                                    num_local_experts=n_exp, num_experts_per_tok=k)  # fmt: skip
    torch.manual_seed(seed)
    block = GptOssMLP(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * scale)
    return block.eval()


def gpt_oss_layer(block, n_exp: int, k: int) -> VolumetricLayer:
    """Our MoE layer from a GptOssMLP: [d, 2I] interleaved (gate even, up odd) -> [I, d] rows."""
    cfg = MoEConfig(n_exp, k, WIDTH, "softmax_topk", True, router_bias=True, expert_bias=True,
                    activation="swiglu_oai")  # fmt: skip
    layer = VolumetricLayer(type=LayerType.MOE, input_height=D, moe=cfg)
    v = moe.views(layer)
    v.router[...] = block.router.weight.detach().numpy()
    v.router_bias[...] = block.router.bias.detach().numpy()
    ex = block.experts
    gu, gub = ex.gate_up_proj.detach().numpy(), ex.gate_up_proj_bias.detach().numpy()
    down, downb = ex.down_proj.detach().numpy(), ex.down_proj_bias.detach().numpy()
    for e, expert in enumerate(moe.experts(layer)):
        sw = layout.swiglu(expert)
        sw.w_gate[...], sw.w_up[...] = gu[e][:, ::2].T, gu[e][:, 1::2].T
        sw.b_gate[...], sw.b_up[...] = gub[e][::2], gub[e][1::2]
        sw.w_down[...], sw.b_down[...] = down[e].T, downb[e]
    return layer


def _run(block, x: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = block(torch.from_numpy(x)[None])
    return (out[0] if isinstance(out, tuple) else out).detach().numpy()[0]


@pytest.mark.parametrize("n_exp,k,scale", [(6, 2, 0.5), (4, 4, 1.5), (1, 1, 0.5), (8, 3, 3.0)])
def test_gpt_oss_mlp_matches_transformers(n_exp, k, scale):
    block = _gpt_oss_mlp(n_exp, k, seed=n_exp, scale=scale)
    ours = gpt_oss_layer(block, n_exp, k)
    x = np.random.default_rng(2).standard_normal((9, D)).astype(np.float32) * 2
    want = _run(block, x)
    if scale >= 1.5:  # big weights: the clamps at +-7 are hit, so they are checked too
        import torch

        gu = (
            torch.from_numpy(x) @ block.experts.gate_up_proj[0] + block.experts.gate_up_proj_bias[0]
        )
        assert (gu.abs() > 7).any()
    tol = 1e-5 * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(ours.forward(x), want, atol=tol, rtol=0)
    rows = np.stack([ours.forward(r) for r in x])  # decode: one token at a time
    np.testing.assert_allclose(rows, want, atol=tol, rtol=0)


def test_clamped_swiglu_matches_transformers_apply_gate():
    import torch

    block = _gpt_oss_mlp(2, 1, seed=0, scale=1.0)
    gate_up = torch.randn(50, 2 * WIDTH) * 10  # well past the limit of 7 both ways
    want = block.experts._apply_gate(gate_up).numpy()
    g = gate_up.numpy()
    got = moe.clamped_swiglu(g[:, ::2], g[:, 1::2], 1.702, 7.0)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)


def test_granitemoe_matches_transformers():
    import torch
    import transformers
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE

    cfg = transformers.GraniteMoeConfig(hidden_size=D, intermediate_size=WIDTH,
                                        num_local_experts=5, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(3)
    block = GraniteMoeMoE(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    layer = VolumetricLayer(
        type=LayerType.MOE, input_height=D, moe=MoEConfig(5, 2, WIDTH, "softmax_topk")
    )
    moe.views(layer).router[...] = block.router.weight.detach().numpy()
    gu, down = block.experts.gate_up_proj.detach().numpy(), block.experts.down_proj.detach().numpy()
    for e, expert in enumerate(moe.experts(layer)):
        sw = layout.swiglu(expert)  # input_linear [2I, d]: gate rows first, then up
        sw.w_gate[...], sw.w_up[...], sw.w_down[...] = gu[e, :WIDTH], gu[e, WIDTH:], down[e]
    x = np.random.default_rng(4).standard_normal((7, D)).astype(np.float32)
    np.testing.assert_allclose(layer.forward(x), _run(block, x), atol=1e-5, rtol=0)


def test_router_bias_offset_follows_the_shared_gate():
    cfg = MoEConfig(4, 2, WIDTH, shared_intermediate_size=8, router_bias=True)
    layer = VolumetricLayer(type=LayerType.MOE, input_height=D, moe=cfg)
    assert moe.spec(layer) == [("router", (4, D)), ("shared_gate", (1, D)), ("router_bias", (4,))]


@pytest.mark.parametrize(
    "kw",
    [
        {"activation": "gelu"},
        {"swiglu_limit": 0.0},
        {"swiglu_alpha": float("nan")},
        {"gating": "softmax_after"},
    ],  # fmt: skip
)
def test_bad_moe_options_are_refused(kw):
    with pytest.raises(LayerConfigError):
        MoEConfig(4, 2, WIDTH, **kw)


# --- MXFP4 --------------------------------------------------------------------------------------


def test_mxfp4_gguf_blocks_match_gguf_py():
    from gguf import quants

    assert QUANT_SIZES[GGMLType.MXFP4] == (32, 17)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(256, 17), dtype=np.uint8)  # every nibble and scale byte
    raw[:, 0] = np.arange(256, dtype=np.uint8)  # e8m0 0..255, the subnormal 0 and 1 included
    want = quants.dequantize(raw.reshape(8, 32 * 17), GGMLType.MXFP4)  # 8 rows of 1024
    got = dequantize_mxfp4(raw, 1024)
    assert got.shape == (8, 1024) and got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_mxfp4_checkpoint_blocks_match_transformers():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(3, 10, 4, 16), dtype=np.uint8)  # [E, rows, G, 16]
    scales = rng.integers(100, 140, size=(3, 10, 4), dtype=np.uint8)  # [E, rows, G]
    want = convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    ).numpy()  # [E, G*32, rows]: transformers' x @ W layout
    got = dequantize_mxfp4_hf(blocks, scales)  # [E, rows, G*32]: nn.Linear's [out, in]
    np.testing.assert_array_equal(got, want.transpose(0, 2, 1))
    with pytest.raises(WeightMappingError, match="mxfp4_shape"):
        dequantize_mxfp4_hf(blocks, scales[:, :, :3])

"""Each layer kind against references we did not write: HF transformers' own Llama/Qwen3
attention, MLP and decoder-layer modules, and plain formulas written here."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama import modeling_llama as ml
from transformers.models.qwen3 import modeling_qwen3 as mq

from poly import LayerType, VolumetricLayer, layout
from poly.errors import ContextOverflowError, LayerConfigError

RNG = np.random.default_rng(0)


def rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


def hf_attention(kind, d, heads, kv_heads, head_dim, bias, theta=10000.0):
    if kind == "qwen3":
        cfg = Qwen3Config(
            hidden_size=d,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            attention_bias=bias,
            rms_norm_eps=1e-6,
        )
        cfg._attn_implementation = "sdpa"
        return cfg, mq.Qwen3Attention(cfg, 0).eval(), mq.Qwen3RotaryEmbedding(cfg)
    cfg = LlamaConfig(
        hidden_size=d,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        attention_bias=bias,
    )
    cfg._attn_implementation = "sdpa"
    return cfg, ml.LlamaAttention(cfg, 0).eval(), ml.LlamaRotaryEmbedding(cfg)


def randomize(module, scale=0.2):
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn_like(p) * scale + (1.0 if "norm" in name else 0.0))


def copy_attention(layer, attn, qk_norm):
    v = layout.mha(layer)
    for n in "qkvo":
        proj = getattr(attn, f"{n}_proj")
        getattr(v, f"w_{n}")[...] = proj.weight.detach().numpy()
        if proj.bias is not None:
            getattr(v, f"b_{n}")[...] = proj.bias.detach().numpy()
    if qk_norm:
        v.q_norm[...] = attn.q_norm.weight.detach().numpy()
        v.k_norm[...] = attn.k_norm.weight.detach().numpy()


def run_hf_attention(attn, rotary, x, start=0):
    xt = torch.from_numpy(x)[None]
    pos = torch.arange(start, start + x.shape[0])[None]
    with torch.no_grad():
        cos, sin = rotary(xt, pos)
        out = attn(xt, position_embeddings=(cos, sin), attention_mask=None)[0]
    return out[0].numpy()


CASES = [
    # kind, d_model, heads, kv_heads, head_dim, bias
    ("llama", 64, 4, 2, 16, False),  # GQA
    ("llama", 64, 4, 1, 16, True),  # MQA with biases
    ("llama", 64, 4, 4, 24, True),  # query_dim 96 != d_model
    ("qwen3", 64, 4, 2, 24, False),  # q/k norm, query_dim != d_model
]


@pytest.mark.parametrize("case", CASES)
def test_mha_matches_hf_attention(case):
    kind, d, heads, kv, hd, bias = case
    _, attn, rotary = hf_attention(kind, d, heads, kv, hd, bias)
    randomize(attn)
    layer = VolumetricLayer(
        type=LayerType.MHA,
        d_model=d,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hd,
        query_dim=heads * hd,
        max_seq_len=64,
        rms_norm_eps=1e-6,
        qk_norm=kind == "qwen3",
    )
    copy_attention(layer, attn, kind == "qwen3")
    x = RNG.standard_normal((7, d)).astype(np.float32)
    ours = layer.forward(x)
    assert ours.dtype == np.float32
    assert rel_err(ours, run_hf_attention(attn, rotary, x)) < 1e-5


def test_incremental_decoding_equals_full_forward():
    _, attn, _ = hf_attention("qwen3", 64, 4, 2, 24, False)
    randomize(attn)
    layer = VolumetricLayer(
        type=LayerType.MHA,
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        query_dim=96,
        max_seq_len=32,
        qk_norm=True,
    )
    copy_attention(layer, attn, True)
    x = RNG.standard_normal((7, 64)).astype(np.float32)
    full = layer.forward(x)
    layer.reset()
    parts = [layer.forward(x[:5]), layer.forward(x[5:6]), layer.forward(x[6])[None]]
    assert rel_err(np.concatenate(parts), full) < 1e-5
    assert layer.state.length == 7


def test_context_overflow_raises_and_keeps_cache():
    layer = VolumetricLayer(type=LayerType.MHA, d_model=16, num_heads=2, max_seq_len=4)
    layer.forward(np.ones((3, 16), np.float32))
    with pytest.raises(ContextOverflowError):
        layer.forward(np.ones((2, 16), np.float32))
    assert layer.state.length == 3


def test_swiglu_matches_hf_mlp():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96)
    mlp = ml.LlamaMLP(cfg).eval()
    randomize(mlp)
    layer = VolumetricLayer(type=LayerType.SWIGLU, input_height=64, output_height=96)
    v = layout.swiglu(layer)
    v.w_gate[...] = mlp.gate_proj.weight.detach().numpy()
    v.w_up[...] = mlp.up_proj.weight.detach().numpy()
    v.w_down[...] = mlp.down_proj.weight.detach().numpy()
    x = RNG.standard_normal((5, 64)).astype(np.float32)
    with torch.no_grad():
        ref = mlp(torch.from_numpy(x)).numpy()
    out = layer.forward(x)
    assert out.dtype == np.float32 and rel_err(out, ref) < 1e-5


def test_rmsnorm_formula_any_leading_shape():
    layer = VolumetricLayer(type=LayerType.RMSNORM, input_height=32, rms_norm_eps=1e-5)
    gamma = RNG.standard_normal(32).astype(np.float32)
    layout.rmsnorm(layer).gamma[...] = gamma
    x = RNG.standard_normal((2, 3, 32)).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * gamma
    out = layer.forward(x)
    assert out.dtype == np.float32 and out.shape == x.shape and rel_err(out, ref) < 1e-6


def test_sequential_block_is_a_real_prenorm_block():
    """[RMSNorm, MHA, Residual, RMSNorm, SwiGLU, Residual] equals HF's LlamaDecoderLayer."""
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    )
    cfg._attn_implementation = "sdpa"
    hf = ml.LlamaDecoderLayer(cfg, 0).eval()
    randomize(hf)
    rotary = ml.LlamaRotaryEmbedding(cfg)
    subs = [
        VolumetricLayer(type=LayerType.RMSNORM, input_height=64, rms_norm_eps=1e-5),
        VolumetricLayer(
            type=LayerType.MHA, d_model=64, num_heads=4, num_kv_heads=2, max_seq_len=16
        ),
        VolumetricLayer(type=LayerType.RESIDUAL, skip="input"),
        VolumetricLayer(type=LayerType.RMSNORM, input_height=64, rms_norm_eps=1e-5),
        VolumetricLayer(type=LayerType.SWIGLU, input_height=64, output_height=96),
        VolumetricLayer(type=LayerType.RESIDUAL, skip=2),
    ]
    block = VolumetricLayer(type=LayerType.SEQUENTIAL, sequential_layers=subs)
    layout.rmsnorm(subs[0]).gamma[...] = hf.input_layernorm.weight.detach().numpy()
    copy_attention(subs[1], hf.self_attn, False)
    layout.rmsnorm(subs[3]).gamma[...] = hf.post_attention_layernorm.weight.detach().numpy()
    sw = layout.swiglu(subs[4])
    sw.w_gate[...] = hf.mlp.gate_proj.weight.detach().numpy()
    sw.w_up[...] = hf.mlp.up_proj.weight.detach().numpy()
    sw.w_down[...] = hf.mlp.down_proj.weight.detach().numpy()
    x = RNG.standard_normal((6, 64)).astype(np.float32)
    xt = torch.from_numpy(x)[None]
    with torch.no_grad():
        cos, sin = rotary(xt, torch.arange(6)[None])
        ref = hf(xt, position_embeddings=(cos, sin), attention_mask=None)
        ref = (ref[0] if isinstance(ref, tuple) else ref)[0].numpy()
    assert rel_err(block.forward(x), ref) < 1e-5


def test_tiled_equals_untiled_and_tile_maps_cover_all_dtypes():
    from poly import DType, VolumetricNetwork

    net = VolumetricNetwork(1, 1, 1, 2)
    net.set_layer(
        0,
        0,
        0,
        0,
        VolumetricLayer(
            type=LayerType.MHA, d_model=64, num_heads=4, num_kv_heads=2, max_seq_len=64
        ),
    )
    net.set_layer(
        0, 0, 0, 1, VolumetricLayer(type=LayerType.SWIGLU, input_height=64, output_height=96)
    )
    for layer in net.layers:
        layer.weights.master[:] = RNG.standard_normal(layer.weights.size).astype(np.float32) * 0.2
    x = RNG.standard_normal((40, 64)).astype(np.float32)
    ref = net.forward(x)
    for tile in (8, 16, 0):
        net.reset()
        net.enable_tiling(tile)
        out = net.forward(x)
        assert rel_err(out, ref) < 1e-5, tile
    for layer in net.walk():
        for m in (layer.cpu_tile_sizes, layer.gpu_sc_tile_sizes, layer.gpu_mc_tile_sizes):
            assert set(m) == set(DType) and all(v > 0 for v in m.values())


def test_bad_dimensions_are_typed_errors():
    with pytest.raises(LayerConfigError):
        VolumetricLayer(type=LayerType.MHA, d_model=64, num_heads=5)
    with pytest.raises(LayerConfigError):
        VolumetricLayer(type=LayerType.MHA, d_model=64, num_heads=4, head_dim=16, query_dim=80)
    with pytest.raises(LayerConfigError):
        VolumetricLayer(type="NotAKind")

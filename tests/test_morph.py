"""morph_layer / morph_network: every dtype runs forward from its stored representation."""

import numpy as np
import pytest

from poly import DType, LayerType, TransformerConfig, VolumetricLayer, morph_layer
from poly.model.morph import morph_network
from poly.quant.qtensor import CodedMatrix
from tests.tiny_model import random_transformer

# Forward error of a morphed layer relative to max|float32 output| (8 tokens, weights ~N(0, 0.1)).
FORWARD_BOUND = {
    DType.FLOAT64: 1e-5,
    DType.FLOAT32: 0.0,
    DType.INT64: 1e-5,
    DType.INT32: 1e-5,
    DType.UINT64: 1e-5,
    DType.UINT32: 1e-5,
    DType.FLOAT16: 2e-3,
    DType.BFLOAT16: 1e-2,
    DType.INT16: 3e-4,
    DType.UINT16: 3e-4,
    DType.INT8: 3e-2,
    DType.UINT8: 3e-2,
    DType.FP8E4M3: 0.15,
    DType.FP8E5M2: 0.2,
    DType.INT4: 0.4,
    DType.UINT4: 0.4,
    DType.FP4: 0.5,
    DType.INT2: 2.5,
    DType.UINT2: 2.5,
    DType.TERNARY: 2.5,
    DType.BINARY: 2.5,
}


def make_layers(rng):
    mha = VolumetricLayer(
        type=LayerType.MHA, d_model=64, num_heads=4, num_kv_heads=2, max_seq_len=32, qk_norm=True
    )
    sw = VolumetricLayer(type=LayerType.SWIGLU, input_height=64, output_height=96)
    for layer in (mha, sw):
        layer.weights.master[:] = rng.standard_normal(layer.weights.size).astype(np.float32) * 0.1
    return mha, sw


@pytest.mark.parametrize("dt", list(DType))
def test_every_dtype_runs_forward_within_its_bound(dt):
    rng = np.random.default_rng(int(dt))
    x = rng.standard_normal((8, 64)).astype(np.float32)
    for layer in make_layers(rng):
        ref = layer.forward(x)
        layer.reset()
        morph_layer(layer, dt)
        out = layer.forward(x)
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        if dt in (DType.INT4, DType.INT8):
            print(f"{dt.label} {layer.type.label} forward rel. error vs float32: {err:.4f}")
        assert out.dtype == np.float32 and np.all(np.isfinite(out))
        assert err <= FORWARD_BOUND[dt], (dt.label, layer.type.label, err)
        assert layer.dtype == dt
        if dt != DType.FLOAT32:
            stored = layer.weights.versions[dt.label]
            w = stored["w_q"] if layer.type == LayerType.MHA else stored["w_gate"]
            assert isinstance(w, CodedMatrix)  # the forward read this, not a float32 copy
        # back to float32 restores the exact master output
        layer.reset()
        morph_layer(layer, DType.FLOAT32)
        assert np.array_equal(layer.forward(x), ref)


def test_quantized_storage_is_smaller():
    mha, _ = make_layers(np.random.default_rng(1))
    morph_layer(mha, DType.INT4)
    w = mha.weights.versions["int4"]["w_q"]
    assert w.nbytes < 64 * 64 * 4 / 6  # 4-bit codes plus per-row scales


def test_morph_network_recurses_and_keeps_norms_float32():
    cfg = TransformerConfig(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
    )
    # the fill the 5% bound below was set with: masters ~N(0.05, 0.1), tables ~N(0, 0.5), final
    # norm left at 1
    tf = random_transformer(
        cfg,
        seed=2,
        master_scale=0.1,
        master_mean=0.05,
        embed_scale=0.5,
        head_scale=0.5,
        final_norm_scale=None,
    )
    ref = tf.forward_all([1, 2, 3, 4])
    tf.reset()
    morph_network(tf.network, DType.INT8)
    assert tf.attn_norm(0).dtype == DType.FLOAT32 and tf.attn_norm(0).weights.active is None
    assert tf.attn(1).dtype == DType.INT8 and tf.mlp(0).dtype == DType.INT8
    out = tf.forward_all([1, 2, 3, 4])
    assert np.abs(out - ref).max() / np.abs(ref).max() < 0.05
    # recursive morph_layer on a Sequential block reaches its sub-layers
    morph_layer(tf.block(0), DType.FLOAT16)
    assert tf.attn(0).dtype == DType.FLOAT16 and tf.attn_norm(0).dtype == DType.FLOAT16

"""The q8_0 KV cache (`Transformer.kv_cache_dtype = "q8_0"`, poly/nn/kvcache.py): blocks of 32
values with a float16 scale, as llama.cpp's q8_0 K/V cache. Its blocks are the gguf package's
Q8_0 blocks (llama.cpp's Python reference). The model reference: transformers' eager attention
reading its keys and values through those gguf Q8_0 blocks (`_hf_q8`): logits and greedy tokens
agree on tiny random checkpoints, with a sliding window and across a saved state too; the KL
divergence from unquantized transformers stays small, on the fused C step (csrc/decode/kv_q8.h,
the c backend) as on the reference path (numpy)."""

from __future__ import annotations

import numpy as np
import pytest

import entity
from poly.errors import DTypeError, LayerConfigError
from poly.nn.kvcache import q8_dequantize, q8_quantize
from poly.runtime import fused, kernels
from tests.hf_fixtures import hf_logits, make_tiny_checkpoint

PROMPT = [(7 * i + 3) % 290 + 5 for i in range(40)]
WIDE = {"hidden_size": 128}  # head_dim 32: one q8_0 block per head


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("q8"), "llama", seed=7, config_overrides=WIDE
    )


def _q8(path, **kw):
    tf = entity.load(path, **kw)
    tf.kv_cache_dtype = "q8_0"
    return tf


def test_blocks_are_llama_cpp_q8_0():
    import gguf
    from gguf import quants

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 4, 64)) * rng.uniform(0.01, 30, (64, 4, 1))).astype(np.float32)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, codes 0
    codes, scales = q8_quantize(x)
    raw = quants.quantize(x.reshape(-1, 64), gguf.GGMLQuantizationType.Q8_0).reshape(-1, 34)
    want_d = raw[:, :2].copy().view(np.float16).reshape(scales.shape)
    want_q = raw[:, 2:].copy().view(np.int8).reshape(codes.shape)
    np.testing.assert_array_equal(scales, want_d)
    assert np.mean(codes == want_q) > 0.999  # 1/d against /d: a tie may round the other way
    assert np.abs(codes.astype(int) - want_q).max() <= 1
    back = quants.dequantize(raw.reshape(-1, 68), gguf.GGMLQuantizationType.Q8_0)
    np.testing.assert_allclose(q8_dequantize(codes, scales).reshape(-1, 64), back, rtol=0,
                               atol=float(np.abs(scales).max()) * 1.01)  # fmt: skip


def _q8_attention(module, query, key, value, *args, **kwargs):
    """transformers' eager attention over keys and values rounded through gguf's Q8_0 blocks."""
    import gguf
    import torch
    from gguf import quants
    from transformers.models.llama.modeling_llama import eager_attention_forward

    def q8(t):
        x = t.detach().float().numpy().reshape(-1, t.shape[-1])
        kind = gguf.GGMLQuantizationType.Q8_0
        back = quants.dequantize(quants.quantize(x, kind), kind)
        return torch.from_numpy(back.reshape(t.shape)).to(t.dtype)

    return eager_attention_forward(module, query, q8(key), q8(value), *args, **kwargs)


def _hf_q8(path, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Logits at every position of ids and n greedy tokens of transformers with a q8_0 K/V."""
    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register("q8_0_eager", _q8_attention)
    AttentionMaskInterface.register("q8_0_eager", eager_mask)  # eager's additive masks
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="q8_0_eager"
    ).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x, use_cache=False).logits[0].numpy()
        seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, eos_token_id=[], pad_token_id=0)  # fmt: skip
    return logits, seq[0, len(ids) :].tolist()


def _kld(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def logp(z):
        z = z.astype(np.float64)
        z = z - z.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    lp, lq = logp(p_logits), logp(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


@pytest.mark.parametrize("backend", ["c", "numpy"])
def test_q8_cache_against_transformers(llama, backend, float_path):
    kernels.set_backend(backend)
    try:
        tf = _q8(llama)
        assert (fused.plan(tf) is not None) == (backend == "c")  # the C step reads q8_0 rows
        got = tf.forward_all(PROMPT)
        want, want_tokens = _hf_q8(llama, PROMPT, 12)
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)
        ref = hf_logits(llama, PROMPT)  # unquantized: further off, yet close
        assert np.abs(got - ref).max() > 10 * np.abs(got - want).max()
        assert _kld(ref, got).mean() < 2e-3
        tf.reset()
        logits, out = tf.forward(PROMPT), []
        for _ in range(12):
            out.append(int(np.argmax(logits)))
            logits = tf.forward([out[-1]])
        assert out == want_tokens
        per_pos = tf.memory_report()["kv_cache"] / tf.config.max_seq_len
        f32 = 2 * tf.config.num_layers * tf.config.kv_dim * 4
        assert per_pos == pytest.approx(f32 * 8.5 / 32)  # 8.5 bits a value
    finally:
        kernels.set_backend()


def test_c_backend_gives_the_same_logits(llama, float_path):
    outs = []
    for backend in ("c", "numpy"):
        kernels.set_backend(backend)
        try:
            tf = _q8(llama)
            tf.forward(PROMPT[:20])
            outs.append(np.stack([tf.forward([t]) for t in PROMPT[20:]]))
        finally:
            kernels.set_backend()
    # the C step (c) and the reference path (numpy) quantize keys from sums in another order: a
    # value on a rounding tie may take the other code (~1e-3 on the logits from then on)
    diffs = np.abs(outs[0] - outs[1]).max(axis=1)
    assert diffs.max() < 5e-3 and np.median(diffs) < 2e-5, diffs


def test_window_and_state_with_q8(tmp_path):
    over = {**WIDE, "sliding_window": 8, "max_position_embeddings": 256}
    path = make_tiny_checkpoint(tmp_path / "m", "mistral", seed=8, config_overrides=over)
    want_logits, want = _hf_q8(path, PROMPT, 16)
    tf = _q8(path)
    np.testing.assert_allclose(tf.forward_all(PROMPT), want_logits, atol=2e-3, rtol=0)
    tf.reset()
    out = [int(np.argmax(tf.forward(PROMPT)))]  # 40 positions, rows for 20: the long append
    for _ in range(7):
        out.append(int(np.argmax(tf.forward([out[-1]]))))
    assert tf.attn(0).state.start > 0
    tf.save_state(tmp_path / "q8.kv", tokens=PROMPT + out[:-1])
    fresh = _q8(path)
    st = fresh.load_state(tmp_path / "q8.kv")
    logits = fresh.forward([out[-1]])
    for _ in range(8):
        out.append(int(np.argmax(logits)))
        logits = fresh.forward([out[-1]])
    assert st.position == len(PROMPT) + 7 and out == want


def test_q8_needs_blocks_of_32(tmp_path):
    narrow = make_tiny_checkpoint(tmp_path / "n", "llama", seed=1)  # head_dim 16
    tf = entity.load(narrow)
    with pytest.raises(DTypeError, match="multiple of 32"):
        tf.kv_cache_dtype = "q8_0"
    with pytest.raises(DTypeError):
        tf.kv_cache_dtype = "int8"  # the name is q8_0
    assert tf.kv_cache_dtype == np.float32


def test_paged_pool_refuses_q8(llama):
    from poly.serving.kv import ContiguousKV, make_kv
    from poly.serving.paged import PagedKV

    tf = _q8(llama)
    assert isinstance(make_kv(tf), ContiguousKV)  # the default for a q8_0 cache
    with pytest.raises(LayerConfigError, match="q8_0"):
        PagedKV(tf, 8, 16)

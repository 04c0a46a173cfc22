"""Transformer[np.float64]: the high-precision reference path against transformers in float64.

transformers' `.double()` model still rounds three steps through float32 (RMSNorm upcasts to
float32, RoPE computes inv_freq and the angles in float32); the reference below lifts those casts
(`_true_float64`) so both sides compute every step in float64, and the logits agree to ~1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest

import entity
from poly import Transformer, TransformerConfig
from poly.errors import DTypeError
from tests.hf_fixtures import make_tiny_checkpoint
from tests.tiny_model import random_transformer

torch = pytest.importorskip("torch")

PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11]


def _true_float64(model) -> None:
    """Lift transformers' float32 casts in RMSNorm and RoPE (instance-level patches)."""
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    theta = cfg.rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def rope(x, position_ids):
        freqs = position_ids[..., None].double() * inv  # [b, n, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    model.model.rotary_emb.forward = rope
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            eps = module.variance_epsilon

            def norm(h, module=module, eps=eps):
                var = h.pow(2).mean(-1, keepdim=True)
                return module.weight * (h * torch.rsqrt(var + eps))

            module.forward = norm


def _hf64(path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    _true_float64(model)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float64_logits_match_transformers_in_float64(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path / arch, arch, seed=7)
    tf = entity.load(path)
    tf.activation_dtype = np.float64
    ours = tf.forward_all(PROMPT)  # [n, V]
    with torch.no_grad():
        ref = _hf64(path)(torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
    assert ours.dtype == np.float64 and ref.dtype == np.float64
    np.testing.assert_allclose(ours, ref, atol=1e-10 * np.abs(ref).max(), rtol=0)
    # incremental decode on a float64 KV cache reaches the same last-position logits
    tf.reset()
    tf.forward(PROMPT[:-3])
    for t in PROMPT[-3:-1]:
        tf.forward([t])
    last = tf.forward([PROMPT[-1]])
    assert last.dtype == np.float64
    np.testing.assert_allclose(last, ref[-1], atol=1e-10 * np.abs(ref).max(), rtol=0)


def test_float64_is_closer_to_the_float64_reference_than_float32(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama", seed=3)
    tf = entity.load(path)
    with torch.no_grad():
        ref = _hf64(path)(torch.tensor([PROMPT]), use_cache=False).logits[0].numpy()
    err32 = np.abs(tf.forward_all(PROMPT) - ref).max()
    tf.reset()
    tf.activation_dtype = np.float64
    err64 = np.abs(tf.forward_all(PROMPT) - ref).max()
    assert err64 < err32 / 1000


def _cfg() -> TransformerConfig:
    return TransformerConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, max_seq_len=32,
    )  # fmt: skip


def test_transformer_subscript_sets_the_activation_dtype():
    model = Transformer[np.float64].from_config(_cfg())
    assert isinstance(model, Transformer)
    assert model.activation_dtype == np.float64
    assert model.forward([1, 2, 3]).dtype == np.float64
    assert Transformer.from_config(_cfg()).activation_dtype == np.float32
    assert Transformer[np.float32].from_config(_cfg()).forward([1]).dtype == np.float32


@pytest.mark.parametrize("bad", [np.float16, np.int8, "bfloat16", "nope"])
def test_other_activation_dtypes_are_a_typed_error(bad):
    with pytest.raises(DTypeError, match="float32 or float64"):
        Transformer[bad]
    model = random_transformer(_cfg())
    with pytest.raises(DTypeError):
        model.activation_dtype = bad


def test_float64_batch_and_generation_run_the_reference_path():
    model = random_transformer(_cfg(), seed=1)
    model.activation_dtype = np.float64
    states = [model.new_state(), model.new_state()]
    got = model.forward_batch([[1, 2], [3]], states)  # [2, V]
    assert got.dtype == np.float64
    model.reset()
    np.testing.assert_allclose(got[1], model.forward([3]), rtol=0, atol=0)
    done = model.generate([1, 2, 3], max_tokens=4, temperature=0.0)
    assert len(done.tokens) == 4

"""smollm3 (NoPE layers) against transformers on a tiny random checkpoint (eager, float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import entity
from poly.errors import ConfigError
from poly.runtime import fused
from tests.family_helpers import assert_load_error
from tests.hf_fixtures import HIDDEN, INTERMEDIATE, KV_HEADS, VOCAB, set_config_keys

PROMPT = [(5 * i + 7) % 290 + 5 for i in range(40)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = transformers.SmolLM3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=KV_HEADS,
        max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
        no_rope_layer_interval=2, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = transformers.SmolLM3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape))
    path = tmp_path_factory.mktemp("smollm3")
    model.save_pretrained(path)
    return path


def _hf(path):
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = m(x, use_cache=False).logits[0].numpy()
        seq = m.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=32, eos_token_id=[], pad_token_id=0)  # fmt: skip
    return logits, seq[0, len(PROMPT) :].tolist()


def test_smollm3_matches_transformers(checkpoint):
    want, tokens = _hf(checkpoint)
    tf = entity.load(checkpoint)
    assert [tf.attn(i).use_rope for i in range(4)] == [True, False, True, False]
    assert fused.plan(tf) is not None  # NoPE layers in the fused C step
    np.testing.assert_allclose(tf.forward_all(PROMPT), want, atol=1e-4, rtol=0)
    tf.reset()
    logits, got = tf.forward(PROMPT), []
    for _ in range(32):
        got.append(int(np.argmax(logits)))
        logits = tf.forward([got[-1]])
    assert got == tokens


def test_smollm3_entity_f32_is_exact(checkpoint, tmp_path):
    tf = entity.load(checkpoint)
    entity.convert(checkpoint, tmp_path / "m.entity", quant="f32")
    again = entity.load(tmp_path / "m.entity")
    np.testing.assert_array_equal(again.forward_all(PROMPT), tf.forward_all(PROMPT))


def test_bad_no_rope_layers_is_refused_by_name(checkpoint, tmp_path):
    import shutil

    path = shutil.copytree(checkpoint, tmp_path / "bad")
    set_config_keys(path, no_rope_layers=[1, 0])
    assert_load_error(path, ConfigError, "no_rope_layers")

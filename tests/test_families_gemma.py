"""Gemma 1/2/3 (text) against transformers: tiny random checkpoints built by transformers itself
(float32, eager attention) with a non-standard head_dim, GQA, attention biases, random norms,
sliding windows shorter than the prompt, soft-capping and scaled rope; logits at every position
within 1e-4, 32 greedy tokens equal with and without the KV cache, `.entity` f32 exact and q8
close; the path a forward takes (the fused C step runs these recipes); bad keys refused."""

from __future__ import annotations

import numpy as np
import pytest

import entity
from entity.hf.config import load_hf_config
from poly.errors import ConfigError, PolyError
from poly.runtime import fused
from tests import hf_fixtures
from tests.family_helpers import greedy as family_greedy
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint, set_config_keys

N_NEW = 32
WINDOW = 6
PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180, 222, 9]  # 3 x WINDOW
EAGER = {"attn_implementation": "eager"}

# model_type -> (config class, causal-LM class, config keys)
CASES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              {"head_dim": 24, "attention_bias": True, **EAGER}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 24, "num_hidden_layers": 3, "sliding_window": WINDOW,
                "query_pre_attn_scalar": 20, "attn_logit_softcapping": 8.0,
                "final_logit_softcapping": 12.0, **EAGER}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    {"head_dim": 24, "num_hidden_layers": 4, "sliding_window": WINDOW,
                     "query_pre_attn_scalar": 20,
                     "layer_types": ["sliding_attention", "full_attention",
                                     "sliding_attention", "sliding_attention"],
                     "rope_parameters": {
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                     **EAGER}),
}  # fmt: skip
hf_fixtures._ARCH_CONFIG.update(CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma")
    return {mt: make_tiny_checkpoint(root / mt, mt, tied=True, seed=3) for mt in CASES}


@pytest.mark.parametrize("model_type", list(CASES))
def test_logits_and_greedy_match_transformers(checkpoints, model_type):
    path = checkpoints[model_type]
    tf = entity.load(path)
    ours = tf.forward_all(PROMPT)
    np.testing.assert_allclose(ours, hf_logits(path, PROMPT), atol=1e-4, rtol=0)
    want = hf_greedy(path, PROMPT, N_NEW, use_cache=True)
    assert family_greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    assert family_greedy(tf, PROMPT, N_NEW, use_cache=False) == want


def test_the_recipe_takes_the_fused_step(checkpoints):
    # The fused C step runs the Gemma recipes (the greedy tests above run through it)
    for model_type in CASES:
        tf = entity.load(checkpoints[model_type])
        assert not tf.config.plain and fused.plan(tf) is not None


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_entity_file_f32_exact_and_q8(checkpoints, tmp_path, model_type):
    from entity.convert import convert

    path = checkpoints[model_type]
    ref = entity.load(path).forward_all(PROMPT)
    back = entity.load(convert(path, tmp_path / "m.entity", quant="f32").dst)
    assert back.config == entity.load(path).config
    np.testing.assert_array_equal(back.forward_all(PROMPT), ref)
    q8 = entity.load(convert(path, tmp_path / "q8.entity", quant="q8").dst)
    got = q8.forward_all(PROMPT)
    # int8 rows of a random tiny model: most argmaxes hold (no reference beyond our f32 here)
    assert np.mean(np.argmax(got, -1) == np.argmax(ref, -1)) >= 0.75


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("sliding_window", 0, "sliding_window"),
        ("layer_types", ["sliding_attention", "chunked"], "layer_types"),
        ("hidden_activation", "relu", "hidden_activation"),
        ("final_logit_softcapping", -1.0, "final_logit_softcapping"),
        ("rope_parameters", {"rope_type": "wavy", "factor": 2.0}, "wavy"),
    ],
)
def test_bad_keys_are_one_line_errors_naming_the_key(checkpoints, tmp_path, key, value, field):
    import shutil

    path = shutil.copytree(checkpoints["gemma2"], tmp_path / "bad")
    set_config_keys(path, **{key: value})
    with pytest.raises(PolyError) as info:
        load_hf_config(path).to_transformer_config()
    assert field in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, (ConfigError, PolyError))

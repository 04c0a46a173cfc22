"""cohere2 (Command R7B) against transformers: Command-R's parallel block (one LayerNorm without
a bias, GPT-J pair RoPE, logit_scale) with windows of 6 on the sliding layers (default pattern:
three sliding, the fourth global) and RoPE on the sliding layers only (the global one NoPE).
Logits at every position within 1e-4 (float32, eager), 32 greedy tokens equal with and without
the KV cache over a prompt past the window, on the fused C step; .entity f32 exact; GGUF from
llama.cpp's converter (which reads `rotary_pct`, a key transformers 5 no longer writes: added to
the copy it converts); a bad layer_types is one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import entity
from poly.errors import ConfigError
from poly.runtime import fused
from tests import hf_fixtures
from tests.family_helpers import (
    assert_entity_f32_exact,
    assert_load_error,
    assert_matches_transformers,
    converter_root,
)
from tests.hf_fixtures import make_tiny_checkpoint, set_config_keys
from tests.test_moe_hf import PROMPT

N_NEW = 32
KEYS = {"hidden_size": 72, "num_hidden_layers": 4, "layer_norm_eps": 1e-5, "logit_scale": 0.25,
        "sliding_window": 6, "pad_token_id": 0, "attn_implementation": "eager"}  # fmt: skip
VARIANTS = {
    "cohere2": ({}, True),
    "cohere2_biased": ({"attention_bias": True,
                        "layer_types": ["sliding_attention", "full_attention"] * 2}, False),
}  # fmt: skip
for _name, (_over, _) in VARIANTS.items():
    hf_fixtures._ARCH_CONFIG[_name] = ("Cohere2Config", "Cohere2ForCausalLM", {**KEYS, **_over})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cohere2")
    return {
        n: make_tiny_checkpoint(root / n, n, seed=120, tied=t) for n, (_, t) in VARIANTS.items()
    }


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cohere2_matches_transformers(ckpts, name):
    src = ckpts[name]
    tf = entity.load(src)
    full = [3] if name == "cohere2" else [1, 3]
    windows = [tf.attn(i).sliding_window for i in range(4)]
    assert windows == [0 if i in full else 6 for i in range(4)]
    assert [tf.attn(i).use_rope for i in range(4)] == [i not in full for i in range(4)]
    assert fused.plan(tf) is not None
    assert_matches_transformers(tf, src, PROMPT)


def test_cohere2_entity_f32_is_exact(ckpts, tmp_path):
    src = ckpts["cohere2_biased"]
    assert_entity_f32_exact(src, tmp_path, PROMPT)


def test_bad_layer_types_names_the_key(ckpts, tmp_path):
    path = Path(shutil.copytree(ckpts["cohere2"], tmp_path / "m"))
    set_config_keys(path, layer_types=["sliding_attention", "chunked_attention"] * 2)
    assert_load_error(path, ConfigError, "layer_types")


@pytest.mark.slow
def test_cohere2_gguf_from_llama_cpp_matches_transformers(ckpts, tmp_path):
    from benchmarks import llama_convert

    root = converter_root()
    src = ckpts["cohere2"]  # tied: the converter maps a tied head only; llama.cpp's pattern 4
    copy = Path(shutil.copytree(src, tmp_path / "src"))
    set_config_keys(copy, rotary_pct=1.0)
    f32 = entity.load(llama_convert.convert(copy, tmp_path / "c2.f32.gguf", "f32", root))
    assert [f32.attn(i).sliding_window for i in range(4)] == [6, 6, 6, 0]
    assert [f32.attn(i).use_rope for i in range(4)] == [True, True, True, False]
    assert_matches_transformers(f32, src, PROMPT)

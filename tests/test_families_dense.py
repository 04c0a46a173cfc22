"""OLMo 2, Granite and GLM-4 against transformers: tiny random checkpoints built by transformers
itself (float32, eager attention; GQA, head_dim 24 != hidden / heads, attention biases, random
norms, multipliers, partial interleaved rotary, fused gate_up_proj): logits at every position
within 1e-4, 32 greedy tokens equal with and without the KV cache; `.entity` f32 exact and q8
close; GGUF files written by llama.cpp's own converter (f32 within 1e-4, Q8_0 top-1 >= 31/32
along transformers' greedy path); `lucy serve` and `lucy chat` answer with transformers' tokens;
the path a forward takes (the fused C step declines these recipes); bad keys and tensors (HF and
GGUF) refused with one-line errors naming them."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import entity
from benchmarks import llama_convert
from poly.errors import PolyError
from poly.runtime import fused
from tests import hf_fixtures
from tests.family_helpers import (
    assert_load_error,
    assert_matches_transformers,
    assert_top1_along,
    converter_root,
    gguf_edit,
    with_user_token,
)
from tests.family_helpers import greedy as family_greedy
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint, set_config_keys

N_NEW = 32
PROMPT = [(5 * i + 7) % 290 + 5 for i in range(24)]
EAGER = {"attn_implementation": "eager"}

# model_type -> (config class, causal-LM class, config keys)
CASES = {
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              {"head_dim": 24, "attention_bias": True, "num_hidden_layers": 3,
               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0},
               **EAGER}),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                {"attention_bias": True, "embedding_multiplier": 1.5,
                 "residual_multiplier": 0.7, "attention_multiplier": 0.2,
                 "logits_scaling": 0.8, **EAGER}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM",
             {"head_dim": 24, "partial_rotary_factor": 0.5, "pad_token_id": 0,
              "vocab_size": 304, **EAGER}),  # room for llama.cpp's "<|user|>" (GGUF below)
}  # fmt: skip
hf_fixtures._ARCH_CONFIG.update(CASES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return {mt: make_tiny_checkpoint(root / mt, mt, seed=5) for mt in CASES}


@pytest.mark.parametrize("model_type", list(CASES))
def test_logits_and_greedy_match_transformers(checkpoints, model_type):
    path = checkpoints[model_type]
    tf = entity.load(path)
    assert not tf.config.plain and fused.plan(tf) is not None  # the fused C step runs it
    assert_matches_transformers(tf, path, PROMPT)


def test_the_recipes_are_the_families(checkpoints):
    olmo2, glm4 = (entity.load(checkpoints[m]).config for m in ("olmo2", "glm4"))
    assert not olmo2.block.pre_norms and olmo2.attention.qk_norm_all
    assert glm4.attention.rope_interleaved and glm4.attention.partial_rotary_factor == 0.5
    granite = entity.load(checkpoints["granite"]).config
    assert (granite.embedding_scale, granite.residual_multiplier, granite.logit_scale) == (
        1.5, 0.7, 1.25)  # fmt: skip
    assert granite.attention.scale == 0.2


@pytest.mark.parametrize("model_type", list(CASES))
def test_entity_file_f32_exact_and_q8(checkpoints, tmp_path, model_type):
    from entity.convert import convert

    path = checkpoints[model_type]
    tf = entity.load(path)
    ref = tf.forward_all(PROMPT)
    convert(path, tmp_path / "m.entity", quant="f32")
    back = entity.load(tmp_path / "m.entity")
    assert back.config == tf.config
    np.testing.assert_array_equal(back.forward_all(PROMPT), ref)
    convert(path, tmp_path / "q8.entity", quant="q8")
    q8 = entity.load(tmp_path / "q8.entity")
    assert np.mean(np.argmax(q8.forward_all(PROMPT), -1) == np.argmax(ref, -1)) >= 0.9


# --- GGUF files from llama.cpp's own converter ---------------------------------------------------
GGUF_CASES = ("olmo2", "granite", "glm4")


@pytest.fixture(scope="module")
def gguf_files(checkpoints, tmp_path_factory):
    root = converter_root()
    tmp = tmp_path_factory.mktemp("dense_gguf")
    sources = dict(checkpoints, glm4=with_user_token(checkpoints["glm4"], tmp / "glm4_src"))
    return {
        (mt, kind): llama_convert.convert(sources[mt], tmp / f"{mt}.{kind}.gguf", kind, root)
        for mt in GGUF_CASES
        for kind in ("f32", "q8_0")
    }


@pytest.mark.slow
@pytest.mark.parametrize("model_type", GGUF_CASES)
def test_gguf_from_llama_cpp_matches_transformers(checkpoints, gguf_files, model_type):
    path = checkpoints[model_type]
    f32 = entity.load(gguf_files[(model_type, "f32")])
    assert f32.config.architecture == model_type
    np.testing.assert_allclose(f32.forward_all(PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)
    want = hf_greedy(path, PROMPT, N_NEW, use_cache=True)
    assert family_greedy(f32, PROMPT, N_NEW, use_cache=True) == want
    q8 = entity.load(gguf_files[(model_type, "q8_0")])  # top-1 along transformers' greedy path
    assert_top1_along(q8, PROMPT, want)


# --- bad input: one-line typed errors naming the key --------------------------------------------
@pytest.mark.parametrize(
    "model_type, key, value, field",
    [
        ("granite", "attention_multiplier", -1.0, "attention_multiplier"),
        ("granite", "logits_scaling", 0, "logits_scaling"),
        ("glm4", "attention_bias", "sometimes", "attention_bias"),
        (
            "glm4",
            "rope_parameters",
            {"rope_type": "default", "partial_rotary_factor": 1.5},
            "partial_rotary_factor",
        ),
        ("olmo2", "rope_parameters", {"rope_type": "wavy", "factor": 2.0}, "wavy"),
    ],
)
def test_bad_keys_are_one_line_errors_naming_the_key(
    checkpoints, tmp_path, model_type, key, value, field
):
    path = shutil.copytree(checkpoints[model_type], tmp_path / "bad")
    set_config_keys(path, **{key: value})
    with pytest.raises(PolyError) as info:
        entity.load(path)
    assert field in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "model_type, tensor",
    [
        ("olmo2", "model.layers.1.post_feedforward_layernorm.weight"),
        ("olmo2", "model.layers.0.self_attn.k_norm.weight"),
        ("glm4", "model.layers.1.post_self_attn_layernorm.weight"),
        ("glm4", "model.layers.0.mlp.gate_up_proj.weight"),
    ],
)
def test_a_missing_tensor_is_named(checkpoints, tmp_path, model_type, tensor):
    from safetensors.numpy import load_file, save_file

    path = shutil.copytree(checkpoints[model_type], tmp_path / "bad")
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    del tensors[tensor]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(PolyError) as info:
        entity.load(path)
    assert tensor in str(info.value) and "\n" not in str(info.value)


# --- lucy serve and lucy chat --------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["glm4", "olmo2"])
def test_lucy_serve_gives_transformers_tokens(checkpoints, model_type):
    pytest.importorskip("fastapi")
    import json

    from tests.serve_helpers import post, running_server

    path = checkpoints[model_type]
    want = hf_greedy(path, PROMPT, 12)
    if hf_fixtures.EOS_ID in want:  # the server stops at the end-of-sequence token
        want = want[: want.index(hf_fixtures.EOS_ID)]
    text = entity.load(path).tokenizer.decode(want)
    body = {"model": path.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    with running_server(path, "--max-batch", "2") as (base, _):
        status, got = post(base + "/v1/completions", json.dumps(body).encode())
    assert status == 200, got
    assert got["choices"][0]["text"] == text and text


def test_a_block_without_norms_is_refused():
    from poly.errors import LayerConfigError
    from poly.recipe import BlockRecipe

    with pytest.raises(LayerConfigError, match="pre_norms"):
        BlockRecipe(pre_norms=False)  # neither pre- nor post-norms


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, change, match",
    [
        ("olmo2", {"drop": ["blk.1.post_ffw_norm.weight"]}, "blk.1.post_ffw_norm.weight"),
        ("glm4", {"drop": ["blk.0.ffn_up.weight"]}, "blk.0.ffn_up.weight"),
        ("glm4", {"meta": {"glm4.rope.dimension_count": 30}}, "rope.dimension_count"),
        ("granite", {"meta": {"granite.attention.scale": -0.5}}, "attention.scale"),
    ],
)
def test_bad_gguf_is_a_one_line_error_naming_it(gguf_files, tmp_path, model_type, change, match):
    bad = gguf_edit(gguf_files[(model_type, "f32")], tmp_path / "bad.gguf", **change)
    assert_load_error(bad, PolyError, match)


def test_lucy_chat_answers_with_transformers_tokens(checkpoints):
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from tests.serve_helpers import env

    path = checkpoints["glm4"]
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)  # fmt: skip
    want = hf_greedy(path, list(ids), 8)
    if hf_fixtures.EOS_ID in want:  # the chat stops at the end-of-turn token
        want = want[: want.index(hf_fixtures.EOS_ID)]
    assert want  # a reply to compare
    cmd = [sys.executable, "-m", "lucy", "chat", str(path), "--temperature", "0"]
    cmd += ["--max-tokens", "8"]
    out = subprocess.run(cmd, input="Hello there\n", capture_output=True, text=True, env=env(),
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "bot> " + tok.decode(want, skip_special_tokens=True) + "\n" in out.stdout

"""cohere (Command-R) against transformers: one LayerNorm without a bias feeding attention and
the SwiGLU MLP in parallel, RoPE on GPT-J pairs, logit_scale, GQA, head_dim 18, tied and untied
heads, q/k/v/o biases. Logits at every position within 1e-4 (float32), 32 greedy tokens equal
with and without the KV cache, .entity f32 exact and q8 top-1 along the greedy path;
use_qk_norm (not run yet) and a bad logit_scale are one-line errors naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import entity
from poly.errors import ConfigError
from poly.layer import LayerType
from poly.runtime import ckernels, fused
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint, set_config_keys
from tests.test_moe_hf import PROMPT, greedy

N_NEW = 32
VARIANTS = {"tied": ({}, True), "biased": ({"attention_bias": True}, False)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("cohere")
    return {
        name: make_tiny_checkpoint(
            tmp / name, "cohere", seed=100 + i, tied=tied, config_overrides=over
        )
        for i, (name, (over, tied)) in enumerate(VARIANTS.items())
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cohere_logits_and_greedy_match_transformers(ckpts, variant):
    src = ckpts[variant]
    tf = entity.load(src)
    assert tf.attn_norm(0).type == LayerType.LAYERNORM and tf.config.block.shared_norm
    assert tf.config.logit_scale == 0.25 and tf.attn(0).rope_interleaved
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(src, PROMPT), atol=1e-4, rtol=0)
    want = hf_greedy(src, PROMPT, N_NEW)
    assert greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(tf, PROMPT, N_NEW, use_cache=False) == want


def test_cohere_runs_the_fused_step(ckpts):
    """The fused C step implements llama's block only: its plan declines the parallel block."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["tied"])
    assert fused.plan(tf) is not None and fused.prepare(tf)


def test_cohere_entity_f32_exact_and_q8_top1(ckpts, tmp_path):
    src = ckpts["biased"]
    ref = entity.load(src).forward_all(PROMPT)
    f32 = tmp_path / "cohere.f32.entity"
    entity.convert(src, f32, quant="f32")
    np.testing.assert_array_equal(entity.load(f32).forward_all(PROMPT), ref)
    q8 = tmp_path / "cohere.q8.entity"
    entity.convert(src, q8, quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    logits = entity.load(q8).forward_all(PROMPT + want[:-1])[len(PROMPT) - 1 :]  # teacher-forced
    assert int((logits.argmax(-1) == np.array(want)).sum()) >= 31


@pytest.mark.parametrize(
    "changes, key",
    [({"use_qk_norm": True}, "use_qk_norm"), ({"logit_scale": -1.0}, "logit_scale")],
)
def test_bad_config_names_the_key(ckpts, tmp_path, changes, key):
    path = Path(shutil.copytree(ckpts["tied"], tmp_path / "m"))
    set_config_keys(path, **changes)
    with pytest.raises(ConfigError, match=key) as e:
        entity.load(path)
    assert "\n" not in str(e.value)


# --- GGUF files from llama.cpp's own converter (arch command-r; it maps a tied head only) -------
@pytest.fixture(scope="module")
def gguf_files(ckpts, tmp_path_factory) -> dict[str, Path]:
    from benchmarks import llama_convert

    root = llama_convert.converter_dir()
    if root is None:
        pytest.skip("llama.cpp converter (llama-cpp-python sdist) not available")
    tmp = tmp_path_factory.mktemp("cohere_gguf")
    return {
        kind: llama_convert.convert(ckpts["tied"], tmp / f"cohere.{kind}.gguf", kind, root)
        for kind in ("f32", "q8_0")
    }


@pytest.mark.slow
def test_gguf_from_llama_cpp_matches_transformers(ckpts, gguf_files):
    src = ckpts["tied"]
    f32 = entity.load(gguf_files["f32"])
    assert f32.config.logit_scale == 0.25 and f32.attn(0).rope_interleaved
    np.testing.assert_allclose(f32.forward_all(PROMPT), hf_logits(src, PROMPT), atol=1e-4, rtol=0)
    want = hf_greedy(src, PROMPT, N_NEW)
    assert greedy(f32, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(f32, PROMPT, N_NEW, use_cache=False) == want
    q8 = entity.load(gguf_files["q8_0"])  # top-1 along transformers' greedy path
    logits = q8.forward_all(PROMPT + want[:-1])[len(PROMPT) - 1 :]
    assert int((logits.argmax(-1) == np.array(want)).sum()) >= 31
    assert fused.plan(q8) is not None

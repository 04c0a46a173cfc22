"""phi3 (Phi-3/3.5/4) against transformers: q/k/v fused in qkv_proj and gate/up in gate_up_proj
(split at load), longrope (long factors past original_max_position_embeddings, short ones
below), a partial rotary, GQA, head_dim 18 and a window of 6 (the prompt is 20 tokens). Logits
at every position within 1e-4 (float32), 32 greedy tokens equal with and without the KV cache,
.entity f32 exact and q8 top-1 along the greedy path; a wrong fused shape is a one-line error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import entity
from poly.errors import WeightMappingError
from poly.runtime import ckernels, fused
from tests.family_helpers import (
    assert_load_error,
    assert_matches_transformers,
    assert_top1_along,
    converter_root,
)
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint
from tests.test_moe_gguf import rewrite_gguf
from tests.test_moe_hf import PROMPT

N_NEW = 32
_PARTIAL_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.6,
                 "short_factor": [1.0 + 0.2 * i for i in range(6)],
                 "long_factor": [3.0 + 0.5 * i for i in range(6)]}  # fmt: skip
VARIANTS = {
    # the prompt (20) is past 16: every position runs on the long factors
    "long": ({"original_max_position_embeddings": 16}, False),
    # 20 + 32 stays below 64: the short factors; 12 of each head's 20 dims rotate
    "partial": (
        {
            "original_max_position_embeddings": 64,
            "hidden_size": 80,
            "rope_parameters": _PARTIAL_ROPE,
        },
        True,
    ),  # fmt: skip
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("phi3")
    return {
        name: make_tiny_checkpoint(
            tmp / name, "phi3", seed=70 + i, tied=tied, config_overrides=over
        )  # fmt: skip
        for i, (name, (over, tied)) in enumerate(VARIANTS.items())
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_phi3_logits_and_greedy_match_transformers(ckpts, variant):
    src = ckpts[variant]
    tf = entity.load(src)
    assert tf.attn(0).sliding_window == 6 and tf.config.rope_scaling.rope_type == "longrope"
    assert tf.attn(0).rotary_dim == (12 if variant == "partial" else 18)
    assert_matches_transformers(tf, src, PROMPT)


def test_phi3_longrope_takes_the_fused_step(ckpts):
    """longrope's frequencies depend on the length a call reaches: the fused step takes them
    from tables whose rows are written per call (poly/runtime/fused_rope.py; logits and tokens
    against transformers in tests/test_fused_recipes.py)."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["long"])
    assert fused.plan(tf) is not None and fused.prepare(tf)
    np.testing.assert_allclose(tf.forward(PROMPT), hf_logits(ckpts["long"], PROMPT)[-1], atol=1e-4)


def test_phi3_entity_f32_exact_and_q8_top1(ckpts, tmp_path):
    src = ckpts["partial"]
    ref = entity.load(src).forward_all(PROMPT)
    f32 = tmp_path / "phi3.f32.entity"
    entity.convert(src, f32, quant="f32")
    np.testing.assert_array_equal(entity.load(f32).forward_all(PROMPT), ref)
    q8 = tmp_path / "phi3.q8.entity"
    entity.convert(src, q8, quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    assert_top1_along(entity.load(q8), PROMPT, want)  # teacher-forced


@pytest.mark.parametrize(
    "name, cut",
    [
        ("model.layers.1.self_attn.qkv_proj.weight", 18),
        ("model.layers.0.mlp.gate_up_proj.weight", 1),
    ],
)
def test_a_wrong_fused_shape_is_named(ckpts, tmp_path, name, cut):
    path = Path(shutil.copytree(ckpts["long"], tmp_path / "m"))
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = tensors[name][:-cut]  # one kv head (or one up row) short
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert_load_error(path, WeightMappingError, f"tensor '{name}' has shape")


# --- GGUF files from llama.cpp's own converter (arch phi3: fused attn_qkv and ffn_up kept fused,
# the longrope factors as tensors, attention.sliding_window) ------------------------------------
@pytest.fixture(scope="module")
def gguf_files(ckpts, tmp_path_factory) -> dict[tuple[str, str], Path]:
    from benchmarks import llama_convert

    root = converter_root()
    tmp = tmp_path_factory.mktemp("phi3_gguf")
    out = {}
    for variant in VARIANTS:
        # the converter reads a GPT-2 BPE vocab when tokenizer_class says so (else tokenizer.model)
        src = Path(shutil.copytree(ckpts[variant], tmp / variant))
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        (src / "tokenizer_config.json").write_text(json.dumps(cfg))
        for kind in ("f32", "q8_0"):
            out[(variant, kind)] = llama_convert.convert(
                src, tmp / f"{variant}.{kind}.gguf", kind, root
            )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_from_llama_cpp_matches_transformers(ckpts, gguf_files, variant):
    src = ckpts[variant]
    f32 = entity.load(gguf_files[(variant, "f32")])
    assert f32.config.rope_scaling.rope_type == "longrope" and f32.attn(0).sliding_window == 6
    assert f32.attn(0).rotary_dim == (12 if variant == "partial" else 18)
    want = assert_matches_transformers(f32, src, PROMPT)
    q8 = entity.load(gguf_files[(variant, "q8_0")])  # top-1 along transformers' greedy path
    assert_top1_along(q8, PROMPT, want)
    assert fused.plan(q8) is not None  # longrope in the fused step (poly/runtime/fused_rope.py)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["blk.0.attn_qkv.weight", "blk.1.ffn_up.weight", "rope_factors_short.weight"]
)
def test_a_wrong_gguf_tensor_is_named(gguf_files, tmp_path, name):
    bad = rewrite_gguf(gguf_files[("long", "f32")], tmp_path / "bad.gguf", reshape=name)
    assert_load_error(bad, WeightMappingError, f"tensor '{name}' has shape")


def test_older_su_rope_type_is_longrope(ckpts, tmp_path):
    """Phi-3-128k's first config.json said rope_scaling type "su"; transformers reads it as
    longrope (Phi3Config), so do we."""
    path = Path(shutil.copytree(ckpts["long"], tmp_path / "su"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "su"
    (path / "config.json").write_text(json.dumps(cfg))
    tf = entity.load(path)
    assert tf.config.rope_scaling.rope_type == "longrope"
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)

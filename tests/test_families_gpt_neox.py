"""gpt_neox (Pythia, GPT-NeoX) against transformers: query_key_value interleaved per head and
split at load, LayerNorm with a bias, the biased GELU MLP, RoPE over int(18 * 0.25) = 4 of each
head's 18 dims, the parallel residual and the sequential block. Logits at every position within
1e-4 (float32), 32 greedy tokens equal with and without the KV cache, the older config keys
(rotary_pct, rotary_emb_base, layer_norm_eps), .entity f32 exact and q8 top-1 along the greedy
path; bad files are typed one-line errors naming the tensor or key."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import entity
from poly.errors import ConfigError, WeightMappingError
from poly.layer import LayerType
from poly.runtime import ckernels, fused
from tests.family_helpers import (
    assert_load_error,
    assert_matches_transformers,
    assert_top1_along,
    converter_root,
)
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint, set_config_keys
from tests.test_moe_hf import PROMPT

N_NEW = 32
VARIANTS = {
    "parallel": {},
    "sequential": {"use_parallel_residual": False, "hidden_act": "gelu_new"},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("gpt_neox")
    return {
        name: make_tiny_checkpoint(tmp / name, "gpt_neox", seed=80 + i, config_overrides=over)
        for i, (name, over) in enumerate(VARIANTS.items())
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpt_neox_logits_and_greedy_match_transformers(ckpts, variant):
    src = ckpts[variant]
    tf = entity.load(src)
    assert tf.config.block.parallel == (variant == "parallel")
    assert tf.attn_norm(0).type == LayerType.LAYERNORM and tf.attn(0).rotary_dim == 4
    assert_matches_transformers(tf, src, PROMPT)


def test_older_config_keys(ckpts, tmp_path):
    """Pythia's config.json: rotary_pct, rotary_emb_base and layer_norm_eps, no rope_parameters."""
    path = Path(shutil.copytree(ckpts["parallel"], tmp_path / "old"))
    set_config_keys(path, rope_parameters=None, rms_norm_eps=None, rotary_pct=0.25,
                    rotary_emb_base=500.0, layer_norm_eps=1e-3)  # fmt: skip
    tf = entity.load(path)
    assert tf.config.rope_theta == 500.0 and tf.config.rms_norm_eps == 1e-3
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(path, PROMPT), atol=1e-4, rtol=0)


def test_gpt_neox_runs_the_fused_step(ckpts):
    """The fused C step implements llama's block only: its plan declines LayerNorm blocks."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["parallel"])
    assert fused.plan(tf) is not None and fused.prepare(tf)


def test_gpt_neox_entity_f32_exact_and_q8_top1(ckpts, tmp_path):
    src = ckpts["parallel"]
    ref = entity.load(src).forward_all(PROMPT)
    f32 = tmp_path / "neox.f32.entity"
    entity.convert(src, f32, quant="f32")
    np.testing.assert_array_equal(entity.load(f32).forward_all(PROMPT), ref)
    q8 = tmp_path / "neox.q8.entity"
    entity.convert(src, q8, quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    assert_top1_along(entity.load(q8), PROMPT, want)  # teacher-forced


@pytest.fixture
def scratch(ckpts, tmp_path) -> Path:
    return Path(shutil.copytree(ckpts["parallel"], tmp_path / "m"))


def _edit(path: Path, name: str, cut: int | None) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    if cut is None:
        del tensors[name]
    else:
        tensors[name] = tensors[name][:-cut]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name, cut, says",
    [
        ("gpt_neox.layers.1.attention.query_key_value.weight", 18, "has shape"),
        ("gpt_neox.layers.0.attention.query_key_value.bias", None, "missing tensor"),
        ("gpt_neox.final_layer_norm.bias", None, "missing tensor"),
    ],
)
def test_a_bad_tensor_is_named(scratch, name, cut, says):
    _edit(scratch, name, cut)
    assert_load_error(scratch, WeightMappingError, f"{says} '{name}'|tensor '{name}' {says}")


def test_bad_use_parallel_residual_names_the_key(scratch):
    set_config_keys(scratch, use_parallel_residual="yes")
    with pytest.raises(ConfigError, match="use_parallel_residual"):
        entity.load(scratch)


# --- GGUF files from llama.cpp's own converter (arch gptneox: query_key_value re-stacked) --------
@pytest.fixture(scope="module")
def gguf_files(ckpts, tmp_path_factory) -> dict[str, Path]:
    from benchmarks import llama_convert

    root = converter_root()
    tmp = tmp_path_factory.mktemp("neox_gguf")
    # transformers 5's AutoConfig folds rotary_pct into rope_parameters; the converter reads it
    return {
        kind: llama_convert.convert(
            ckpts["parallel"], tmp / f"neox.{kind}.gguf", kind, root, hparams={"rotary_pct": 0.25}
        )  # fmt: skip
        for kind in ("f32", "q8_0")
    }


@pytest.mark.slow
def test_gguf_from_llama_cpp_matches_transformers(ckpts, gguf_files):
    src = ckpts["parallel"]
    f32 = entity.load(gguf_files["f32"])
    assert f32.config.block.parallel and f32.attn(0).rotary_dim == 4
    want = assert_matches_transformers(f32, src, PROMPT)
    q8 = entity.load(gguf_files["q8_0"])  # top-1 along transformers' greedy path
    assert_top1_along(q8, PROMPT, want)
    assert fused.plan(q8) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["blk.1.attn_qkv.weight", "blk.0.attn_qkv.bias"])
def test_a_wrong_fused_gguf_tensor_is_named(gguf_files, tmp_path, name):
    from tests.test_moe_gguf import rewrite_gguf

    bad = rewrite_gguf(gguf_files["f32"], tmp_path / "bad.gguf", reshape=name)
    assert_load_error(bad, WeightMappingError, f"tensor '{name}' has shape")

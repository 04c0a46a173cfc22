"""The LayerNorm families of issue 58 against transformers: StarCoder2 (LayerNorm with a bias,
the biased GELU MLP, q/k/v/o biases, a sliding window shorter than the prompt). Logits at every
position within 1e-4 (float32, eager), 32 greedy tokens equal with and without the KV cache,
.entity f32 exact and q8 top-1 along the greedy path; bad files are typed one-line errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import entity
from poly.errors import ConfigError, UnsupportedError, WeightMappingError
from poly.layer import Activation, LayerType
from poly.runtime import ckernels, fused, kernels
from tests.family_helpers import (
    assert_load_error,
    assert_matches_transformers,
    assert_top1_along,
    converter_root,
)
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint, set_config_keys
from tests.test_moe_hf import PROMPT  # 20 ids: more than 3x the window of 6

N_NEW = 32
VARIANTS = {"biased": {}, "unbiased": {"use_bias": False, "hidden_act": "gelu"}}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("starcoder2")
    return {
        name: make_tiny_checkpoint(tmp / name, "starcoder2", seed=58 + i, config_overrides=over)
        for i, (name, over) in enumerate(VARIANTS.items())
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_starcoder2_logits_and_greedy_match_transformers(ckpts, variant):
    src = ckpts[variant]
    tf = entity.load(src)
    assert tf.attn_norm(0).type == LayerType.LAYERNORM and tf.mlp(0).type == LayerType.GELU_MLP
    want_act = Activation.GELU_ERF if variant == "unbiased" else Activation.GELU
    assert tf.mlp(0).activation == want_act and tf.attn(0).sliding_window == 6
    assert_matches_transformers(tf, src, PROMPT)


def test_starcoder2_runs_the_fused_step(ckpts):
    """The fused C step implements llama's block only: its plan declines LayerNorm blocks."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["biased"])
    assert kernels.backend() == "c" and fused.plan(tf) is not None
    assert fused.prepare(tf)


def test_starcoder2_entity_f32_exact_and_q8_top1(ckpts, tmp_path):
    src = ckpts["biased"]
    ref = entity.load(src).forward_all(PROMPT)
    f32 = tmp_path / "sc2.f32.entity"
    entity.convert(src, f32, quant="f32")
    np.testing.assert_array_equal(entity.load(f32).forward_all(PROMPT), ref)
    q8 = tmp_path / "sc2.q8.entity"
    entity.convert(src, q8, quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    assert_top1_along(entity.load(q8), PROMPT, want)  # teacher-forced


@pytest.fixture
def scratch(ckpts, tmp_path) -> Path:
    return Path(shutil.copytree(ckpts["biased"], tmp_path / "m"))


def _drop(path: Path, name: str) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "name",
    ["model.norm.bias", "model.layers.1.mlp.c_fc.bias", "model.layers.0.input_layernorm.bias"],
)
def test_a_missing_bias_tensor_is_named(scratch, name):
    _drop(scratch, name)
    assert_load_error(scratch, WeightMappingError, f"missing tensor '{name}'")


def test_unknown_activation_and_bad_use_bias_name_the_key(scratch):
    set_config_keys(scratch, hidden_act="gelu_fast")
    with pytest.raises(UnsupportedError, match="hidden_act 'gelu_fast'"):
        entity.load(scratch)
    set_config_keys(scratch, hidden_act="gelu_pytorch_tanh", use_bias="yes")
    with pytest.raises((ConfigError, UnsupportedError), match="use_bias|attention_bias"):
        entity.load(scratch)


# --- GGUF files from llama.cpp's own converter (arch starcoder2). Its files carry no sliding
# window (llama.cpp attends to every position), so the checkpoint here has none. ---------------
@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    from benchmarks import llama_convert

    root = converter_root()
    tmp = tmp_path_factory.mktemp("sc2_gguf")
    src = make_tiny_checkpoint(tmp / "hf", "starcoder2", seed=61,
                               config_overrides={"sliding_window": None})  # fmt: skip
    out = {k: llama_convert.convert(src, tmp / f"sc2.{k}.gguf", k, root) for k in ("f32", "q8_0")}
    return {"hf": src, **out}


@pytest.mark.slow
def test_starcoder2_gguf_from_llama_cpp_matches_transformers(gguf_files):
    src = gguf_files["hf"]
    f32 = entity.load(gguf_files["f32"])
    assert f32.attn_norm(0).type == LayerType.LAYERNORM and f32.attn(0).sliding_window == 0
    want = assert_matches_transformers(f32, src, PROMPT)
    q8 = entity.load(gguf_files["q8_0"])  # top-1 along transformers' greedy path
    assert_top1_along(q8, PROMPT, want)
    assert fused.plan(q8) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["output_norm.bias", "blk.1.attn_norm.bias", "blk.0.ffn_up.bias"])
def test_a_wrong_starcoder2_gguf_bias_is_named(gguf_files, tmp_path, name):
    from tests.test_moe_gguf import rewrite_gguf

    bad = rewrite_gguf(gguf_files["f32"], tmp_path / "bad.gguf", reshape=name)
    assert_load_error(bad, WeightMappingError, f"tensor '{name}' has shape")

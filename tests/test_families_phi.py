"""phi (Phi-2) against transformers: one shared LayerNorm (with a bias) feeding attention and the
MLP in parallel, biased q/k/v/dense, RoPE over 8 of each head's 20 dims, the biased GELU MLP
(gelu_new and exact gelu), GQA, the final LayerNorm's bias and the LM head's bias. Logits at
every position within 1e-4 (float32), 32 greedy tokens equal with and without the KV cache,
.entity f32 exact and q8 top-1 along the greedy path (the LM head's bias rides in the output
vectors blob); qk_layernorm (a biased LayerNorm over each head of q and k, before the partial
RoPE) on the fused C step (decode asserted to run) and over thread ranks; bad files are typed one-line errors naming the tensor or key. llama.cpp's phi2 has no q/k
norm tensors, so qk_layernorm has no GGUF test."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import entity
from poly.errors import ConfigError, WeightMappingError
from poly.nn import mha
from poly.runtime import ckernels, fused
from tests.family_helpers import (
    assert_load_error,
    assert_matches_transformers,
    assert_top1_along,
    converter_root,
)
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint, set_config_keys
from tests.test_moe_hf import PROMPT, greedy

N_NEW = 32
VARIANTS = {
    "gqa": {},
    "mha_erf": {"hidden_act": "gelu", "num_key_value_heads": 4},
    "qk_ln": {"qk_layernorm": True},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("phi")
    return {
        name: make_tiny_checkpoint(tmp / name, "phi", seed=90 + i, config_overrides=over)
        for i, (name, over) in enumerate(VARIANTS.items())
    }


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_phi_logits_and_greedy_match_transformers(ckpts, variant):
    src = ckpts[variant]
    tf = entity.load(src)
    assert tf.config.block.shared_norm and tf.attn(0).rotary_dim == 8
    assert tf.lm_head_bias is not None and np.abs(tf.lm_head_bias).max() > 0
    assert tf.config.qk_norm == (variant == "qk_ln")
    assert_matches_transformers(tf, src, PROMPT)


def test_phi_runs_the_fused_step(ckpts):
    """The fused C step takes phi's parallel block and its biased head."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["gqa"])
    assert fused.plan(tf) is not None and fused.prepare(tf)


def test_phi_qk_layernorm_runs_the_fused_step(ckpts, monkeypatch):
    """q/k LayerNorms (random weights and biases, as transformers') run in the C step: decode
    runs, and generation matches transformers."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["qk_ln"])
    views = mha.views(tf.attn(0))
    assert views.q_norm.shape == views.k_norm_bias.shape == (tf.config.head_dim,)
    assert np.abs(views.q_norm_bias).max() > 0
    assert fused.plan(tf) is not None and fused.prepare(tf)
    calls, decode = [], ckernels.decode
    monkeypatch.setattr(ckernels, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    assert greedy(tf, PROMPT, 8, use_cache=True) == hf_greedy(ckpts["qk_ln"], PROMPT, 8)
    assert len(calls) >= 8


def test_phi_qk_layernorm_splits_over_thread_ranks(ckpts):
    """Tensor parallelism gives each rank the shared q/k norm weights and their biases."""
    from poly.runtime.tp import shard
    from tests.test_tp_shard import in_threads, run_steps

    model = entity.load(ckpts["qk_ln"])
    want = run_steps(model)
    model.reset()
    got = in_threads(2, lambda r, comm: run_steps(shard(model, comm)))
    for r in range(2):
        assert np.abs(got[r] - want).max() / np.abs(want).max() <= 1e-5


@pytest.mark.parametrize("variant", ["gqa", "qk_ln"])
def test_phi_entity_f32_exact_and_q8_top1(ckpts, tmp_path, variant):
    src = ckpts[variant]
    ref = entity.load(src).forward_all(PROMPT)
    f32 = tmp_path / "phi.f32.entity"
    entity.convert(src, f32, quant="f32")
    np.testing.assert_array_equal(entity.load(f32).forward_all(PROMPT), ref)
    q8 = tmp_path / "phi.q8.entity"
    entity.convert(src, q8, quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    assert_top1_along(entity.load(q8), PROMPT, want)  # teacher-forced


@pytest.fixture
def scratch(ckpts, tmp_path) -> Path:
    return Path(shutil.copytree(ckpts["gqa"], tmp_path / "m"))


@pytest.mark.parametrize(
    "name", ["lm_head.bias", "model.final_layernorm.bias", "model.layers.1.self_attn.dense.bias"]
)
def test_a_missing_bias_is_named(scratch, name):
    tensors = load_file(str(scratch / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(scratch / "model.safetensors"), metadata={"format": "pt"})
    assert_load_error(scratch, WeightMappingError, f"missing tensor '{name}'")


def test_a_bad_qk_layernorm_is_refused_by_name(scratch):
    set_config_keys(scratch, qk_layernorm="yes")
    assert_load_error(scratch, ConfigError, "qk_layernorm")


def test_a_missing_qk_layernorm_bias_is_named(ckpts, tmp_path):
    path = Path(shutil.copytree(ckpts["qk_ln"], tmp_path / "m"))
    name = "model.layers.0.self_attn.k_layernorm.bias"
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert_load_error(path, WeightMappingError, f"missing tensor '{name}'")


def test_eval_window_logits_use_the_biased_head(ckpts):
    """lucy eval's scored logits are transformers' (the LM head's bias included)."""
    from poly.text.evaluate import window_logits

    src = ckpts["gqa"]
    logits, targets = next(window_logits(entity.load(src), PROMPT, n_ctx=len(PROMPT)))
    first = len(PROMPT) // 2
    np.testing.assert_allclose(logits, hf_logits(src, PROMPT)[first:-1], atol=1e-4, rtol=0)
    assert list(targets) == PROMPT[first + 1 :]


# --- GGUF files from llama.cpp's own converter (arch phi2) ---------------------------------------
@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """llama.cpp's phi2 writes feed_forward_length 4 x hidden and kv heads = heads (as Phi-2)."""
    from benchmarks import llama_convert

    root = converter_root()
    tmp = tmp_path_factory.mktemp("phi_gguf")
    over = {"num_key_value_heads": 4, "intermediate_size": 320}
    src = make_tiny_checkpoint(tmp / "hf", "phi", seed=95, config_overrides=over)
    out = {k: llama_convert.convert(src, tmp / f"phi.{k}.gguf", k, root) for k in ("f32", "q8_0")}
    return {"hf": src, **out}


@pytest.mark.slow
def test_gguf_from_llama_cpp_matches_transformers(gguf_files):
    src = gguf_files["hf"]
    f32 = entity.load(gguf_files["f32"])
    assert f32.lm_head_bias is not None and f32.attn(0).rotary_dim == 8
    want = assert_matches_transformers(f32, src, PROMPT)
    q8 = entity.load(gguf_files["q8_0"])  # top-1 along transformers' greedy path
    assert_top1_along(q8, PROMPT, want)
    assert fused.plan(q8) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["output.bias", "output_norm.bias", "blk.1.ffn_up.bias"])
def test_a_wrong_gguf_bias_is_named(gguf_files, tmp_path, name):
    from tests.test_moe_gguf import rewrite_gguf

    bad = rewrite_gguf(gguf_files["f32"], tmp_path / "bad.gguf", reshape=name)
    assert_load_error(bad, WeightMappingError, f"tensor '{name}' has shape")

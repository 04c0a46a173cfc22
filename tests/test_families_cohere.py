"""cohere (Command-R) against transformers: one LayerNorm without a bias feeding attention and
the SwiGLU MLP in parallel, RoPE on GPT-J pairs, logit_scale, GQA, head_dim 18, tied and untied
heads, q/k/v/o biases. Logits at every position within 1e-4 (float32), 32 greedy tokens equal
with and without the KV cache, .entity f32 exact and q8 top-1 along the greedy path;
use_qk_norm (Command-R+: a LayerNorm per head of q and k, each head its own weights) against
transformers on the fused C step (decode asserted to run) and split over thread ranks; a bad use_qk_norm or logit_scale is a one-line error naming the key."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import entity
from poly.errors import ConfigError
from poly.layer import LayerType
from poly.nn import mha
from poly.runtime import ckernels, fused
from tests.family_helpers import (
    assert_load_error,
    assert_matches_transformers,
    assert_top1_along,
    converter_root,
)
from tests.hf_fixtures import hf_greedy, make_tiny_checkpoint, set_config_keys
from tests.test_moe_hf import PROMPT, greedy

N_NEW = 32
VARIANTS = {
    "tied": ({}, True),
    "biased": ({"attention_bias": True}, False),
    "qk_norm": ({"use_qk_norm": True, "attention_bias": True}, False),
}


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
    assert tf.config.qk_norm == (variant == "qk_norm")
    assert tf.config.logit_scale == 0.25 and tf.attn(0).rope_interleaved
    assert_matches_transformers(tf, src, PROMPT)


def test_cohere_runs_the_fused_step(ckpts):
    """The fused C step takes the parallel block with its shared LayerNorm."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["tied"])
    assert fused.plan(tf) is not None and fused.prepare(tf)


def test_cohere_qk_norm_runs_the_fused_step(ckpts, monkeypatch):
    """Per-head q/k LayerNorms (every row differs, as transformers') run in the C step: decode
    runs, and generation matches transformers."""
    if not ckernels.AVAILABLE:
        pytest.skip("C kernels not built")
    tf = entity.load(ckpts["qk_norm"])
    q_norm = mha.views(tf.attn(0)).q_norm.reshape(tf.config.num_heads, -1)
    assert not np.allclose(q_norm[0], q_norm[1])
    assert fused.plan(tf) is not None and fused.prepare(tf)
    calls, decode = [], ckernels.decode
    monkeypatch.setattr(ckernels, "decode", lambda *a, **k: calls.append(1) or decode(*a, **k))
    assert greedy(tf, PROMPT, 8, use_cache=True) == hf_greedy(ckpts["qk_norm"], PROMPT, 8)
    assert len(calls) >= 8


def test_cohere_qk_norm_splits_over_thread_ranks(ckpts):
    """Tensor parallelism keeps each rank's rows of the per-head norm weights."""
    from poly.runtime.tp import shard
    from tests.test_tp_shard import in_threads, run_steps

    model = entity.load(ckpts["qk_norm"])
    want = run_steps(model)
    model.reset()
    got = in_threads(2, lambda r, comm: run_steps(shard(model, comm)))
    for r in range(2):
        assert np.abs(got[r] - want).max() / np.abs(want).max() <= 1e-5


@pytest.mark.parametrize("variant", ["biased", "qk_norm"])
def test_cohere_entity_f32_exact_and_q8_top1(ckpts, tmp_path, variant):
    src = ckpts[variant]
    ref = entity.load(src).forward_all(PROMPT)
    f32 = tmp_path / "cohere.f32.entity"
    entity.convert(src, f32, quant="f32")
    np.testing.assert_array_equal(entity.load(f32).forward_all(PROMPT), ref)
    q8 = tmp_path / "cohere.q8.entity"
    entity.convert(src, q8, quant="q8")
    want = hf_greedy(src, PROMPT, N_NEW)
    assert_top1_along(entity.load(q8), PROMPT, want)  # teacher-forced


@pytest.mark.parametrize(
    "changes, key",
    [({"use_qk_norm": "yes"}, "use_qk_norm"), ({"logit_scale": -1.0}, "logit_scale")],
)
def test_bad_config_names_the_key(ckpts, tmp_path, changes, key):
    path = Path(shutil.copytree(ckpts["tied"], tmp_path / "m"))
    set_config_keys(path, **changes)
    assert_load_error(path, ConfigError, key)


# --- GGUF files from llama.cpp's own converter (arch command-r; it maps a tied head only) -------
@pytest.fixture(scope="module")
def gguf_files(ckpts, tmp_path_factory) -> dict[str, Path]:
    from benchmarks import llama_convert

    root = converter_root()
    tmp = tmp_path_factory.mktemp("cohere_gguf")
    # Command-R+'s per-head q/k norms: the converter writes attn_q_norm [heads, head_dim]
    over = {"use_qk_norm": True, "attention_bias": True}
    qk = make_tiny_checkpoint(tmp / "qk", "cohere", seed=107, tied=True, config_overrides=over)
    out = {}
    for name, src in (("tied", ckpts["tied"]), ("qk_norm", qk)):
        out[name] = {"hf": src} | {
            kind: llama_convert.convert(src, tmp / f"cohere.{name}.{kind}.gguf", kind, root)
            for kind in ("f32", "q8_0")
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tied", "qk_norm"])
def test_gguf_from_llama_cpp_matches_transformers(gguf_files, variant):
    src, files = gguf_files[variant]["hf"], gguf_files[variant]
    f32 = entity.load(files["f32"])
    assert f32.config.logit_scale == 0.25 and f32.attn(0).rope_interleaved
    assert f32.config.qk_norm == (variant == "qk_norm")
    want = assert_matches_transformers(f32, src, PROMPT)
    q8 = entity.load(files["q8_0"])  # top-1 along transformers' greedy path
    assert_top1_along(q8, PROMPT, want)
    assert fused.plan(q8) is not None

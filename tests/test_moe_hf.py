"""Acceptance (#14): tiny random Mixtral, Qwen2-MoE (shared expert, norm_topk_prob=False, a
dense mlp_only layer) and Qwen3-MoE (head_dim != hidden/heads, tied embeddings) built with
transformers load with parity: all-position logits within 1e-4, greedy 32 tokens identical with
the KV cache and with full re-runs. References come from transformers itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import entity
from poly.layer import LayerType
from tests.family_helpers import greedy
from tests.hf_fixtures import MOE_ARCHS, VOCAB, hf_greedy, hf_logits, make_tiny_checkpoint

PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 64, 128, 200, 11, 33, 77, 1, 180, 222, 9, 150, 299]
N_NEW = 32
TIED = {"mixtral": False, "qwen2_moe": False, "qwen3_moe": True}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        a: make_tiny_checkpoint(root / a, a, tied=TIED[a], seed=40 + i)
        for i, a in enumerate(MOE_ARCHS)
    }


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_and_greedy_match_transformers(moe_checkpoints, arch):
    path = moe_checkpoints[arch]
    tf = entity.load(path)
    assert tf.tied == TIED[arch]
    kinds = [tf.mlp(i).type for i in range(tf.config.num_layers)]
    assert LayerType.MOE in kinds
    ours = tf.forward_all(PROMPT)
    ref = hf_logits(path, PROMPT)
    assert ours.shape == (len(PROMPT), VOCAB)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    want = hf_greedy(path, PROMPT, N_NEW, use_cache=True)
    assert greedy(tf, PROMPT, N_NEW, use_cache=True) == want
    assert greedy(tf, PROMPT, N_NEW, use_cache=False) == want


def test_qwen2_moe_shape_of_the_import(moe_checkpoints):
    tf = entity.load(moe_checkpoints["qwen2_moe"])
    moe = tf.mlp(0).moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (6, 2, False)
    assert moe.shared_intermediate_size == 48 and moe.dense_layers == (1,)
    assert tf.mlp(1).type == LayerType.SWIGLU  # mlp_only_layers=[1]
    assert len(tf.mlp(0).sequential_layers) == 7  # 6 experts + the shared one


def test_qwen3_moe_head_dim(moe_checkpoints):
    tf = entity.load(moe_checkpoints["qwen3_moe"])
    assert tf.config.head_dim == 24 and tf.config.head_dim * tf.config.num_heads != 64


def test_bad_moe_checkpoints_are_typed_one_line_errors(moe_checkpoints, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    from poly.errors import ConfigError, WeightMappingError
    from tests.hf_fixtures import set_config_keys

    bad = tmp_path / "topk"
    shutil.copytree(moe_checkpoints["qwen3_moe"], bad)
    set_config_keys(bad, num_experts_per_tok=9)  # 8 experts
    with pytest.raises(ConfigError, match="top_k 9 exceeds num_experts 8"):
        entity.load(bad)
    bad = tmp_path / "router"
    shutil.copytree(moe_checkpoints["qwen3_moe"], bad)
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.1.mlp.gate.weight"
    tensors[name] = tensors[name][:7]  # a router of 7 rows for 8 experts
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightMappingError, match=r"mlp.gate.weight' has shape \(7, 64\)"):
        entity.load(bad)
    bad = tmp_path / "expert"
    shutil.copytree(moe_checkpoints["mixtral"], bad)
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightMappingError, match="missing tensor .*experts.3.w2.weight"):
        entity.load(bad)

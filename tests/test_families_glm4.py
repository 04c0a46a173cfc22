"""GLM-4 beyond tests/test_families_dense.py's default checkpoint (q/k/v biases, half rotary):
without attention biases (`attention_bias` false: q/k/v unbiased, as transformers builds it) and
with other `partial_rotary_factor`s (a quarter: 6 of 24 dims; all of them), against
transformers (float32, eager): logits at every position within 1e-4, 32 greedy tokens equal
with and without the KV cache, the fused C step taken; .entity f32 exact; GGUF files from
llama.cpp's own converter (its rope.dimension_count carries the factor)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import entity
from poly.nn import mha
from poly.runtime import fused
from tests import hf_fixtures
from tests.family_helpers import (
    assert_entity_f32_exact,
    assert_matches_transformers,
    converter_root,
    with_user_token,
)
from tests.hf_fixtures import make_tiny_checkpoint
from tests.test_families_dense import CASES as DENSE
from tests.test_families_dense import PROMPT

N_NEW = 32
_, _, BASE = DENSE["glm4"]
# name -> (config keys, rotated dims of head_dim 24, q/k/v biased)
VARIANTS = {
    "glm4_nobias_quarter": ({"attention_bias": False, "partial_rotary_factor": 0.25}, 6, False),
    "glm4_bias_full": ({"attention_bias": True, "partial_rotary_factor": 1.0}, 24, True),
}
for _name, (_keys, _, _) in VARIANTS.items():
    hf_fixtures._ARCH_CONFIG[_name] = ("Glm4Config", "Glm4ForCausalLM", {**BASE, **_keys})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4")
    return {name: make_tiny_checkpoint(root / name, name, seed=41) for name in VARIANTS}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_glm4_variant_matches_transformers(ckpts, name):
    _, rot, biased = VARIANTS[name]
    path = ckpts[name]
    tf = entity.load(path)
    assert tf.config.attention_bias == biased and tf.attn(0).rotary_dim == rot
    # transformers' q/k/v biases (randomised by the fixture) are read; without them, zeros
    assert (np.abs(mha.views(tf.attn(0)).b_q).max() > 0) == biased
    assert fused.plan(tf) is not None  # the fused C step runs it
    assert_matches_transformers(tf, path, PROMPT)


def test_glm4_without_biases_has_no_bias_tensors(ckpts):
    """What transformers wrote: no q/k/v bias tensors at all (so nothing is read as zeros)."""
    from safetensors import safe_open

    (file,) = ckpts["glm4_nobias_quarter"].glob("*.safetensors")
    with safe_open(str(file), "np") as f:
        assert not [n for n in f.keys() if n.endswith("proj.bias")]


def test_glm4_entity_f32_is_exact(ckpts, tmp_path):
    src = ckpts["glm4_nobias_quarter"]
    assert_entity_f32_exact(src, tmp_path, PROMPT)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_glm4_gguf_from_llama_cpp_matches_transformers(ckpts, tmp_path, name):
    from benchmarks import llama_convert

    root = converter_root()
    _, rot, biased = VARIANTS[name]
    path = ckpts[name]
    src = with_user_token(path, tmp_path / "src")
    f32 = entity.load(llama_convert.convert(src, tmp_path / "glm4.f32.gguf", "f32", root))
    assert f32.config.attention_bias == biased and f32.attn(0).rotary_dim == rot
    assert_matches_transformers(f32, path, PROMPT)

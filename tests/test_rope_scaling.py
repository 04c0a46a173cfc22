"""Scaled rotary embeddings (linear, yarn, dynamic, longrope) against transformers' own tiny
llama checkpoints.

The prompt is longer than yarn's original_max_position_embeddings, so the interpolated
frequencies and yarn's cos/sin factor both shape every logit past the start.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import entity
from entity.hf.config import load_hf_config
from poly import RopeScaling
from poly.errors import ConfigError, LayerConfigError, UnsupportedError
from poly.ops import HOOKS
from poly.rope import rope_frequencies
from tests.fuzz.corpus import F32, STRING, gguf_model
from tests.hf_fixtures import make_tiny_checkpoint, set_config_keys

PROMPT = [(7 * i + 3) % 290 + 5 for i in range(48)]  # 48 > original_max_position_embeddings 32
N_NEW = 16
ROPES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    # every yarn knob off its default: the ramp's dims, no truncation, mscale's attention factor
    "yarn-knobs": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                   "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False,
                   "mscale": 1.0, "mscale_all_dim": 0.5},
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(ROPES))
def checkpoint(request, tmp_path_factory):
    rope = dict(ROPES[request.param], rope_theta=10000.0)
    over = {"rope_parameters": rope, "max_position_embeddings": 128}  # 128 = 4 x 32
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), "llama", config_overrides=over
    )


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def _hf_run(path, ids: list[int]) -> tuple[np.ndarray, list[int]]:
    """transformers' float32 logits at every position of `ids`, and its N_NEW greedy tokens."""
    import torch

    model = _hf_model(str(path))
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(x, use_cache=False).logits[0].numpy()
        seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N_NEW, eos_token_id=[], pad_token_id=0)  # fmt: skip
    return logits, seq[0, len(ids) :].tolist()


def _greedy(tf) -> list[int]:
    """N_NEW greedy tokens after PROMPT, one token a call on the KV cache."""
    logits, got = tf.forward(PROMPT), []
    for _ in range(N_NEW):
        got.append(int(np.argmax(logits)))
        logits = tf.forward([got[-1]])
    return got


def test_logits_and_greedy_match_transformers(checkpoint):
    assert HOOKS["rope_inplace"] is not None  # the default backend: C kernels
    assert load_hf_config(checkpoint).rope_scaling is not None
    want_logits, want_tokens = _hf_run(checkpoint, PROMPT)
    tf = entity.load(checkpoint)
    np.testing.assert_allclose(tf.forward_all(PROMPT), want_logits, atol=1e-4, rtol=0)
    tf.reset()  # one token a call: the fused C decode step reads the same scaled tables
    steps = np.stack([tf.forward([t]) for t in PROMPT])
    np.testing.assert_allclose(steps, want_logits, atol=1e-4, rtol=0)
    tf.reset()
    assert _greedy(tf) == want_tokens


def test_entity_file_keeps_the_scaling(checkpoint, tmp_path):
    # The .entity header stores the RopeScaling record; reloading rebuilds the same tables.
    entity.convert(checkpoint, tmp_path / "m.entity", quant="f32")
    got = entity.load(tmp_path / "m.entity").forward_all(PROMPT)
    np.testing.assert_allclose(got, _hf_run(checkpoint, PROMPT)[0], atol=1e-4, rtol=0)


# Recomputed per call from the length it reaches (transformers' dynamic_rope_update): dynamic
# NTK past max_position_embeddings (32 < the 48-token prompt), longrope's long factors past
# original_max_position_embeddings (32), its short ones below.
PER_CALL = {
    "dynamic": ({"rope_type": "dynamic", "factor": 3.0}, 32),
    "longrope": ({"rope_type": "longrope", "original_max_position_embeddings": 32,
                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                  "long_factor": [1.2, 1.9, 2.8, 4.0, 5.5, 7.3, 9.4, 11.8]}, 128),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(PER_CALL))
def per_call(request, tmp_path_factory):
    rope, positions = PER_CALL[request.param]
    over = {"rope_parameters": dict(rope, rope_theta=10000.0), "max_position_embeddings": positions}
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), "llama", seed=4, config_overrides=over
    )


def test_per_call_rope_matches_transformers(per_call):
    # logits of the 48-token prompt in one call, and generate()'s greedy tokens on its cache
    # (the frequencies of each call: the prompt's, then each longer length's)
    want_logits, want_tokens = _hf_run(per_call, PROMPT)
    tf = entity.load(per_call, max_seq_len=128)
    np.testing.assert_allclose(tf.forward_all(PROMPT), want_logits, atol=1e-4, rtol=0)
    tf.reset()
    assert _greedy(tf) == want_tokens
    # below the threshold the scaling changes nothing but longrope's short factors
    short = PROMPT[:24]
    tf.reset()
    np.testing.assert_allclose(
        tf.forward_all(short), _hf_run(per_call, short)[0], atol=1e-4, rtol=0
    )


def test_per_call_rope_from_its_entity_file(per_call, tmp_path):
    entity.convert(per_call, tmp_path / "m.entity", quant="f32")
    tf = entity.load(tmp_path / "m.entity", max_seq_len=128)
    np.testing.assert_allclose(
        tf.forward_all(PROMPT), _hf_run(per_call, PROMPT)[0], atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    "rope,needle",
    [
        ({"rope_type": "made-up", "factor": 2.0}, "rope_scaling type 'made-up' is not supported"),
        ({"rope_type": "longrope", "factor": 2.0}, "short_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 8}, "long_factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 3},
         "short_factor"),
    ],
)  # fmt: skip
def test_bad_rope_is_refused_by_name(tmp_path, rope, needle):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    set_config_keys(path, rope_parameters=dict(rope, rope_theta=1e4))
    with pytest.raises((UnsupportedError, ConfigError, LayerConfigError), match=needle) as e:
        entity.load(path)
    assert "\n" not in str(e.value)


def test_rope_scaling_record_refuses_unknown_and_incomplete():
    with pytest.raises(LayerConfigError, match="'made-up'"):
        RopeScaling(factor=2.0, rope_type="made-up")
    with pytest.raises(LayerConfigError, match="short_factor, long_factor"):
        RopeScaling(factor=2.0, rope_type="longrope", original_max_position_embeddings=32)


@pytest.mark.parametrize(
    "top,rope",
    [
        # factor None: max_position_embeddings / a top-level original length (64 / 16)
        ({"original_max_position_embeddings": 16}, {"rope_type": "yarn", "factor": None}),
        ({}, {"rope_type": "yarn", "factor": 2.0}),  # original length: max_position_embeddings
        ({}, {"rope_type": "linear", "factor": 3}),
    ],
)
def test_rope_keys_resolve_as_transformers_does(tmp_path, top, rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    set_config_keys(path, rope_parameters=dict(rope, rope_theta=1e4), rope_scaling=None,
                    max_position_embeddings=64, **top)  # fmt: skip
    ref = LlamaConfig.from_pretrained(path)
    inv, attention = ROPE_INIT_FUNCTIONS[rope["rope_type"]](ref, "cpu")
    tc = load_hf_config(path).to_transformer_config()
    ours, ours_attention = rope_frequencies(tc.head_dim, tc.rope_theta, tc.rope_scaling)
    np.testing.assert_allclose(ours, inv.numpy(), rtol=1e-6)
    assert ours_attention == pytest.approx(attention, rel=1e-12)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_gguf_from_llama_cpp_converter_matches_transformers(tmp_path, kind):
    # llama.cpp's converter writes rope.scaling.{type,factor,original_context_length}.
    from benchmarks import llama_convert

    root = llama_convert.converter_dir()
    if root is None:
        pytest.skip("llama.cpp converter (llama-cpp-python sdist) not available")
    over = {
        "rope_parameters": dict(ROPES[kind], rope_theta=10000.0),
        "max_position_embeddings": 128,
    }
    src = make_tiny_checkpoint(tmp_path / kind, "llama", seed=3, config_overrides=over)
    gguf = llama_convert.convert(src, tmp_path / f"{kind}.gguf", "f32", root)
    want_logits, want_tokens = _hf_run(src, PROMPT)
    tf = entity.load(gguf)
    assert tf.config.rope_scaling.rope_type == kind
    np.testing.assert_allclose(tf.forward_all(PROMPT), want_logits, atol=1e-4, rtol=0)
    tf.reset()
    assert _greedy(tf) == want_tokens


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"llama.rope.scaling.type": (STRING, "longrope")}, "'longrope'"),
        ({"llama.rope.scaling.type": (STRING, "yarn"),
          "llama.rope.scaling.yarn_ext_factor": (F32, 0.5)}, "yarn_ext_factor"),
    ],
)  # fmt: skip
def test_gguf_rope_scaling_it_cannot_compute_is_refused(tmp_path, changes, needle):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_model(changes))
    with pytest.raises(UnsupportedError, match=needle) as e:
        entity.load(path)
    assert "\n" not in str(e.value)

"""Gemma 1/2/3 (text) GGUF files written by llama.cpp's own converter from tiny transformers
checkpoints (windows shorter than the prompt, soft-capping, a scaled global rope and a local
theta of its own): F32 within 1e-4 of transformers with the same 32 greedy tokens with the KV
cache and without, F16 within 1e-4 of transformers on f16-rounded weights, Q8_0 top-1 equal on
>= 31 of 32 greedy steps. The files store (1 + w) norms already summed.

A GGUF file carries no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5, or by
(hidden / heads) ** -0.5 for the 27B models (46 blocks in Gemma 2, 62 in Gemma 3), which is what
each released size's scalar is; the fixtures use such scalars. Nor does it carry layer_types:
Gemma 3 files slide every layer but each 6th unless attention.sliding_window_pattern says."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import entity
from benchmarks import llama_convert
from tests import hf_fixtures
from tests.family_helpers import greedy as greedy_tokens
from tests.hf_fixtures import hf_greedy, hf_logits, make_tiny_checkpoint, set_config_keys
from tests.test_families_gemma import CASES, PROMPT, WINDOW

N_NEW = 32
HEAD_DIM = 24  # CASES' head_dim; the scalar llama.cpp assumes for all but the 27B models
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}
# Gemma 2/3 weights at 0.15 scale: at the fixtures' 0.2, Q8_0 rounding flips 3 of gemma3's 32
# greedy steps in llama.cpp itself (ours: 2); at 0.15, 1 in both. (Gemma 1 keeps 0.2: its
# biases, which llama.cpp does not load, leave no llama.cpp count to compare.)
_INIT = {"initializer_range": 0.15}
# model_type -> config overrides of CASES' keys (the arch's config class and keys stay)
GGUF_CASES = {
    "gemma": {},
    "gemma2": {**_INIT, "query_pre_attn_scalar": HEAD_DIM},
    "gemma3_text": {**_INIT, "query_pre_attn_scalar": HEAD_DIM, "num_hidden_layers": 6,
                    "layer_types": None, "rope_parameters": GEMMA3_ROPE},
}  # fmt: skip
hf_fixtures._ARCH_CONFIG.update(CASES)
_CACHE: dict[tuple[str, str], Path] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    conv = llama_convert.converter_dir()
    if conv is None:
        pytest.skip("llama.cpp converter (llama-cpp-python sdist) not available")
    return conv, tmp_path_factory.mktemp("gemma_gguf")


def _hf(root, model_type: str, overrides: dict | None = None, name: str | None = None) -> Path:
    """A tiny checkpoint: CASES' keys with `overrides` (None: the config class's default)."""
    name = name or model_type
    if (name, "hf") not in _CACHE:
        over = GGUF_CASES[model_type] if overrides is None else overrides
        _CACHE[(name, "hf")] = make_tiny_checkpoint(
            root[1] / name, model_type, tied=True, seed=5, config_overrides=over
        )
    return _CACHE[(name, "hf")]


def _gguf(root, name: str, kind: str, model_type: str | None = None, overrides=None) -> Path:
    if (name, kind) not in _CACHE:
        conv, tmp = root
        src = _hf(root, model_type or name, overrides, name)
        _CACHE[(name, kind)] = llama_convert.convert(src, tmp / f"{name}.{kind}.gguf", kind, conv)
    return _CACHE[(name, kind)]


def _with_key(src: Path, dst: Path, key: str, flags: np.ndarray) -> Path:
    """A copy of a GGUF file with one more metadata key, a bool array (gguf-py's writer)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_array(key, [bool(f) for f in flags])
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _hf_logits_f16(model_dir: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits with every matrix rounded to float16, as the F16 file stores them
    (the converter keeps 1-D tensors, the norms, in float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(p.half().float())
        return model(torch.tensor([ids]), use_cache=False).logits[0].numpy()


@pytest.mark.parametrize("model_type", list(GGUF_CASES))
def test_f32_gguf_matches_transformers(root, model_type):
    src, path = _hf(root, model_type), _gguf(root, model_type, "f32")
    tf = entity.load(path)
    assert tf.config.architecture == {"gemma3_text": "gemma3"}.get(model_type, model_type)
    np.testing.assert_allclose(tf.forward_all(PROMPT), hf_logits(src, PROMPT), atol=1e-4, rtol=0)
    want = hf_greedy(src, PROMPT, N_NEW)
    assert greedy_tokens(tf, PROMPT, N_NEW, use_cache=True) == want
    assert greedy_tokens(tf, PROMPT, N_NEW, use_cache=False) == want


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(GGUF_CASES))
def test_f16_gguf_matches_transformers_on_rounded_weights(root, model_type):
    tf = entity.load(_gguf(root, model_type, "f16"))
    ref = _hf_logits_f16(_hf(root, model_type), PROMPT)
    np.testing.assert_allclose(tf.forward_all(PROMPT), ref, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(GGUF_CASES))
def test_q8_0_gguf_top1_along_the_greedy_path(root, model_type):
    want = hf_greedy(_hf(root, model_type), PROMPT, N_NEW)
    tf = entity.load(_gguf(root, model_type, "q8_0"))
    logits = tf.forward_all(PROMPT + want[:-1])[len(PROMPT) - 1 :]  # teacher-forced
    assert int((logits.argmax(-1) == np.array(want)).sum()) >= 31


def test_sliding_window_pattern_key_sets_the_sliding_layers(root, tmp_path):
    """A file naming its sliding layers (attention.sliding_window_pattern, one flag per layer,
    as llama.cpp reads it) against transformers with those layer_types on the same weights."""
    src = shutil.copytree(_hf(root, "gemma3_text"), tmp_path / "hf")
    kinds = ["sliding_attention", "full_attention"] * 3
    set_config_keys(src, layer_types=kinds)
    flags = np.array([k == "sliding_attention" for k in kinds])
    path = _with_key(_gguf(root, "gemma3_text", "f32"), tmp_path / "pattern.gguf",
                     "gemma3.attention.sliding_window_pattern", flags)  # fmt: skip
    got = entity.load(path).forward_all(PROMPT)
    np.testing.assert_allclose(got, hf_logits(src, PROMPT), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_gemma2_27b_depth_scales_by_hidden_over_heads(root):
    """46 blocks (Gemma 2 27B's count): llama.cpp scales the logits by (hidden / heads) ** -0.5,
    what the 27B model's query_pre_attn_scalar (144 = 4608 / 32) is, not head_dim ** -0.5."""
    over = {**GGUF_CASES["gemma2"], "num_hidden_layers": 46, "intermediate_size": 32,
            "query_pre_attn_scalar": hf_fixtures.HIDDEN // hf_fixtures.HEADS}  # fmt: skip
    path = _gguf(root, "gemma2_46", "f32", "gemma2", over)
    tf = entity.load(path)
    assert tf.attn(0).attn_scale == pytest.approx(over["query_pre_attn_scalar"] ** -0.5)
    # 46 blocks add up float32 rounding (~4e-4 at the fixtures' 0.2 scale); head_dim's scale
    # would be off by whole units
    np.testing.assert_allclose(
        tf.forward_all(PROMPT), hf_logits(_hf(root, "gemma2", over, "gemma2_46"), PROMPT),
        atol=1e-3, rtol=0,
    )  # fmt: skip
    assert WINDOW < len(PROMPT)

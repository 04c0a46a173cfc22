"""Reliability catalogue B3 (config.json / generation_config.json) and config/weights agreement."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from entity.hf import load_hf
from entity.hf.config import load_hf_config
from poly.errors import (
    CheckpointError,
    ConfigError,
    LimitExceededError,
    UnsupportedError,
)
from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import make_tiny_checkpoint

BASE = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
}


def _dir(tmp_path: Path, config=None, *, raw: str | None = None, generation=None) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    if raw is not None or config is not None:
        (d / "config.json").write_text(raw if raw is not None else json.dumps(config))
    if generation is not None:
        (d / "generation_config.json").write_text(json.dumps(generation))
    return d


def _cfg(**changes):
    out = dict(BASE)
    for k, v in changes.items():
        if v is ...:
            out.pop(k)
        else:
            out[k] = v
    return out


def test_base_config_is_valid(tmp_path):
    cfg = load_hf_config(_dir(tmp_path, BASE))
    assert (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads) == (2, 16, 2)


RAW_CASES = [
    ("B3-36-empty", ""),
    ("B3-36-array", "[]"),
    ("B3-36-string", '"config"'),
    ("B3-36-invalid", "{"),
    ("B3-36-deep", "[" * 100_000 + "]" * 100_000),
    ("B3-37-duplicate", json.dumps(BASE)[:-1] + ', "hidden_size": 128}'),
    ("B3-43-nan-literal", json.dumps(BASE)[:-1] + ', "rope_theta": NaN}'),
    ("B3-15-big-int", json.dumps(BASE)[:-1] + ', "hidden_size": ' + "9" * 5000 + "}"),
]


@pytest.mark.parametrize("raw", [c[1] for c in RAW_CASES], ids=[c[0] for c in RAW_CASES])
def test_bad_json(tmp_path, raw):
    expect_error(lambda: load_hf_config(_dir(tmp_path, raw=raw)), ConfigError, "bad_config")


def test_b3_36_missing(tmp_path):
    exc = expect_error(lambda: load_hf_config(_dir(tmp_path)), CheckpointError)
    assert exc.code in ("bad_config", "not_found")


FIELD_CASES = [
    ("B3-38-string", dict(hidden_size="64"), ConfigError),
    ("B3-38-float", dict(hidden_size=64.0), ConfigError),
    ("B3-38-bool", dict(hidden_size=True), ConfigError),
    ("B3-39-zero-hidden", dict(hidden_size=0), ConfigError),
    ("B3-39-negative-layers", dict(num_hidden_layers=-1), ConfigError),
    ("B3-39-zero-heads", dict(num_attention_heads=0), ConfigError),
    ("B3-39-zero-vocab", dict(vocab_size=0), ConfigError),
    ("B3-40-indivisible", dict(hidden_size=66), ConfigError),
    ("B3-41-gqa", dict(num_key_value_heads=3), ConfigError),
    ("B3-42-vocab", dict(vocab_size=10**12), LimitExceededError),
    ("B3-42-positions", dict(max_position_embeddings=2**40), LimitExceededError),
    ("B3-42-layers", dict(num_hidden_layers=10**6), LimitExceededError),
    ("B3-43-eps-zero", dict(rms_norm_eps=0.0), ConfigError),
    ("B3-43-eps-huge", dict(rms_norm_eps=1e308 * 10), ConfigError),
    ("B3-43-theta-zero", dict(rope_theta=0), ConfigError),
    ("B3-43-theta-neg", dict(rope_theta=-1.0), ConfigError),
    ("B3-44-model-type", dict(model_type="mamba"), UnsupportedError),
    ("B3-44-architectures", dict(architectures=["BertModel"]), UnsupportedError),
    ("B3-47-eos-vocab", dict(eos_token_id=300), ConfigError),
    ("B3-47-bos-negative", dict(bos_token_id=-1), ConfigError),
    ("B3-47-eos-list", dict(eos_token_id=[2, 1000]), ConfigError),
]


@pytest.mark.parametrize(
    "changes,cls", [c[1:] for c in FIELD_CASES], ids=[c[0] for c in FIELD_CASES]
)
def test_bad_field(tmp_path, changes, cls):
    cfg = _cfg(**changes)
    raw = json.dumps(cfg).replace("Infinity", "1e999")  # an overflowing literal, not NaN
    expect_error(lambda: load_hf_config(_dir(tmp_path, raw=raw)), cls, cls.code)


def test_b3_40_head_dim_given_is_accepted(tmp_path):
    # the Kanana case: hidden 1792 = 24 heads x 128 is not required when head_dim is explicit
    cfg = load_hf_config(_dir(tmp_path, _cfg(hidden_size=66, head_dim=16)))
    assert cfg.head_dim == 16 and cfg.hidden_size == 66


def test_b3_45_auto_map_is_never_imported(tmp_path):
    marker = tmp_path / "ran"
    d = _dir(
        tmp_path, _cfg(auto_map={"AutoModelForCausalLM": "evil.Model"}, trust_remote_code=True)
    )
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    try:
        load_hf_config(d)
    except CheckpointError:
        pass  # refusing it is fine too
    assert not marker.exists()


@pytest.mark.parametrize(
    "generation",
    [{"temperature": -1.0, "do_sample": True}, {"top_p": 2.0, "do_sample": True},
     {"top_k": -5}, {"max_new_tokens": 0}, {"repetition_penalty": 0.0}],
    ids=["temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty"],
)  # fmt: skip
def test_b3_48_generation_config(tmp_path, generation):
    d = _dir(tmp_path, BASE, generation=generation)
    exc = expect_error(lambda: load_hf_config(d), ConfigError, "bad_config")
    assert "generation_config.json" in (exc.path or "")


# --- config and weights disagree (B3-46) -------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", "llama")


def _edited(tiny_ckpt, tmp_path, **changes) -> Path:
    d = tmp_path / "edited"
    shutil.copytree(tiny_ckpt, d)
    data = json.loads((d / "config.json").read_text())
    data.update(changes)
    (d / "config.json").write_text(json.dumps(data))
    return d


@pytest.mark.parametrize(
    "changes",
    [{"num_hidden_layers": 3}, {"num_hidden_layers": 1}, {"vocab_size": 400}, {"hidden_size": 32, "head_dim": 16},
     {"intermediate_size": 64}],
    ids=["more-layers", "fewer-layers", "vocab", "hidden", "intermediate"],
)  # fmt: skip
def test_b3_46_config_weights_mismatch(tiny_ckpt, tmp_path, changes):
    d = _edited(tiny_ckpt, tmp_path, **changes)
    exc = expect_error(lambda: load_hf(d), CheckpointError, seconds=10)
    assert exc.code in ("weight_mapping", "integrity"), exc.code


def test_b3_46_missing_lm_head_untied(tiny_ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _edited(tiny_ckpt, tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(d / "model.safetensors"))
    exc = expect_error(lambda: load_hf(d), CheckpointError, seconds=10)
    assert exc.code in ("weight_mapping", "integrity"), exc.code

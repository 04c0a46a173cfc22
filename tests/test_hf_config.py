"""config.json / generation_config.json parsing, checked against transformers' own config classes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entity.hf.config import HFModelConfig, load_hf_config
from poly.errors import ConfigError, LimitExceededError, PolyError, UnsupportedError
from tests.hf_fixtures import ARCHS, make_tiny_checkpoint

BASE = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
    "bos_token_id": 1,
}


def _write(tmp_path: Path, config: dict | str | bytes, generation: dict | None = None) -> Path:
    raw = config if isinstance(config, (str, bytes)) else json.dumps(config)
    (tmp_path / "config.json").write_bytes(raw.encode() if isinstance(raw, str) else raw)
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def _hf(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def _hf_head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@pytest.mark.parametrize("arch", ARCHS)
def test_saved_configs_match_transformers(tmp_path, arch):
    path = make_tiny_checkpoint(tmp_path, arch, tied=arch == "qwen2")
    ours, ref = load_hf_config(path), _hf(path)
    assert ours.model_type == ref.model_type == arch
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size)  # fmt: skip
    assert (ours.num_layers, ours.num_heads, ours.num_kv_heads) == (
        ref.num_hidden_layers, ref.num_attention_heads, ref.num_key_value_heads)  # fmt: skip
    assert ours.head_dim == _hf_head_dim(ref)
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.qk_norm == (arch == "qwen3")
    assert ours.qkv_bias == (arch == "qwen2") and not ours.o_bias


def test_legacy_4x_config_with_llama3_rope(tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = dict(BASE, rope_theta=500000.0, rope_scaling=rope, torch_dtype="bfloat16",
               max_position_embeddings=131072)  # fmt: skip
    path = _write(tmp_path, cfg)
    ours, ref = load_hf_config(path), _hf(path)
    assert ours.rope_theta == ref.rope_parameters["rope_theta"] == 500000.0
    assert ours.rope_scaling is not None
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        assert getattr(ours.rope_scaling, key) == ref.rope_parameters[key]
    assert ours.dtype == "bfloat16"
    tc = ours.to_transformer_config()
    assert tc.rope_scaling.factor == 8.0 and tc.rope_theta == 500000.0
    assert tc.max_seq_len == 4096  # default context, not 131072


def test_sparse_config_defaults_match_transformers(tmp_path):
    cfg = {k: v for k, v in BASE.items() if k not in ("num_key_value_heads", "rms_norm_eps")}
    path = _write(tmp_path, cfg)
    ours, ref = load_hf_config(path), _hf(path)
    assert ours.num_kv_heads == ref.num_key_value_heads == 4
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == ref.max_position_embeddings


def test_qwen3_head_dim_default_matches_transformers(tmp_path):
    cfg = dict(BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"])
    path = _write(tmp_path, cfg)
    assert load_hf_config(path).head_dim == _hf(path).head_dim


def test_explicit_head_dim_skips_divisibility(tmp_path):
    # Kanana-like: hidden not a multiple of heads, valid because head_dim is explicit.
    cfg = dict(BASE, hidden_size=72, num_attention_heads=5, num_key_value_heads=1, head_dim=16)
    assert load_hf_config(_write(tmp_path, cfg)).head_dim == 16


def test_to_transformer_config(tmp_path):
    cfg = dict(
        BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], max_position_embeddings=512
    )
    tc = load_hf_config(_write(tmp_path, cfg)).to_transformer_config()
    assert (tc.vocab_size, tc.hidden_size, tc.num_layers, tc.num_kv_heads, tc.head_dim) == (
        300,
        64,
        2,
        2,
        16,
    )
    assert tc.attention_bias and not tc.qk_norm and tc.max_seq_len == 512
    assert tc.architecture == "qwen2"
    assert load_hf_config(tmp_path).to_transformer_config(max_seq_len=100).max_seq_len == 100


def test_generation_config(tmp_path):
    gen = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
           "eos_token_id": [2, 7], "max_new_tokens": 50}  # fmt: skip
    ours = load_hf_config(_write(tmp_path, dict(BASE, eos_token_id=[5, 2]), gen))
    assert ours.eos_token_ids == (5, 2, 7)
    kw = ours.generation.gen_options_kwargs()
    assert kw == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 50}
    greedy = load_hf_config(_write(tmp_path, BASE, {"temperature": 0.6}))
    assert (
        greedy.generation.gen_options_kwargs()["temperature"] == 0.0
    )  # do_sample defaults to false


BAD_CONFIGS = [
    ({"hidden_size": None}, ConfigError, "hidden_size"),
    ({"model_type": None}, ConfigError, "model_type"),
    ({"hidden_size": "64"}, ConfigError, "hidden_size"),
    ({"hidden_size": 64.0}, ConfigError, "hidden_size"),
    ({"num_hidden_layers": True}, ConfigError, "num_hidden_layers"),
    ({"num_attention_heads": 0}, ConfigError, "num_attention_heads"),
    ({"intermediate_size": -1}, ConfigError, "intermediate_size"),
    ({"num_key_value_heads": 3}, ConfigError, "num_key_value_heads"),
    ({"hidden_size": 66}, ConfigError, "hidden_size"),
    ({"vocab_size": 10**12}, LimitExceededError, "vocab_size"),
    ({"num_hidden_layers": 10**6}, LimitExceededError, "num_hidden_layers"),
    ({"max_position_embeddings": 2**40}, LimitExceededError, "max_position_embeddings"),
    ({"rms_norm_eps": 0.0}, ConfigError, "rms_norm_eps"),
    ({"rope_theta": 0.0}, ConfigError, "rope_theta"),
    ({"eos_token_id": 300}, ConfigError, "special_token_id"),
    ({"eos_token_id": [2, -1]}, ConfigError, "special_token_id"),
    ({"model_type": "gemma"}, UnsupportedError, "gemma"),
    ({"model_type": "phi3"}, UnsupportedError, "phi3"),
    ({"model_type": "gpt2"}, UnsupportedError, "gpt2"),
    ({"architectures": ["LlamaForSequenceClassification"]}, UnsupportedError, "architectures"),
    ({"mlp_bias": True}, UnsupportedError, "mlp_bias"),
    ({"hidden_act": "gelu"}, UnsupportedError, "gelu"),
    ({"torch_dtype": "float8_e4m3fn"}, UnsupportedError, "float8"),
    ({"rope_scaling": {"type": "linear"}}, ConfigError, "factor"),
    ({"rope_scaling": {"rope_type": "made-up", "factor": 2.0}}, UnsupportedError, "made-up"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, ConfigError, "short_factor"),
    (
        {"sliding_window": 0, "model_type": "mistral", "architectures": None},
        ConfigError,
        "sliding_window",
    ),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, ConfigError, "factor"),
    (
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
        UnsupportedError,
        "partial_rotary_factor",
    ),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, ConfigError, "low_freq_factor"),
    # poly.RopeScaling's range checks, raised at parse time as the file's error
    (
        {"rope_scaling": {"rope_type": "linear", "factor": -2.0}},
        ConfigError,
        "rope_scaling: .*positive",
    ),
]


@pytest.mark.parametrize("change,error,needle", BAD_CONFIGS, ids=lambda x: str(x)[:40])
def test_bad_configs(tmp_path, change, error, needle):
    cfg = dict(BASE, **change)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(error, match=needle) as info:
        load_hf_config(_write(tmp_path, cfg))
    assert type(info.value) is error


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b"", "json"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"model_type": "llama", "model_type": "llama"}', "duplicate_key"),
        (b'{"rms_norm_eps": NaN}', "NaN"),
        (b"\xff\xfe{}", "json"),
        (b"[" * 100000, "json"),
    ],
)
def test_malformed_json(tmp_path, raw, needle):
    with pytest.raises(ConfigError, match=needle):
        load_hf_config(_write(tmp_path, raw))


def test_an_overflowing_number_is_refused_as_nan_is(tmp_path):
    """JSON's 1e999 parses to infinity: refused like the NaN/Infinity constants, naming the key."""
    text = json.dumps(dict(BASE, rms_norm_eps=12345.0)).replace("12345.0", "1e999")
    with pytest.raises(ConfigError, match="rms_norm_eps: must be a finite number"):
        load_hf_config(_write(tmp_path, text.encode()))


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="missing"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("gen,needle", [({"temperature": -1.0}, "temperature"), ({"top_p": 2.0}, "top_p"),
                                        ({"top_k": -5}, "top_k"), ({"max_new_tokens": 0}, "max_new_tokens"),
                                        ({"do_sample": "yes"}, "do_sample")])  # fmt: skip
def test_bad_generation_config_names_the_file(tmp_path, gen, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        load_hf_config(_write(tmp_path, BASE, gen))
    assert info.value.path.endswith("generation_config.json")


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(sorted(BASE) + ["head_dim", "rope_parameters", "rope_scaling"]), _json
    )
)
def test_fuzzed_configs_raise_only_poly_errors(overrides):
    try:
        HFModelConfig.parse(dict(BASE, **overrides))
    except PolyError:
        pass

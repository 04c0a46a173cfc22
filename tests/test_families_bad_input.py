"""Issue 58 acceptance 5: bad input is a typed one-line error naming the key, for every family.
Configs are transformers' own config classes (AutoConfig.for_model) with one key broken: a
sliding window of 0 (each family that reads one), an unknown rope type (every family). Through
the CLI (`lucy convert`, `lucy generate`) on a real GPT-OSS checkpoint: a missing sink tensor, a
window of 0 and an unknown rope type are one stderr line and the documented exit code
(poly.errors.EXIT_CODES: 4 bad input file, 5 unsupported). GGUF files from llama.cpp's converter
with the sink tensor dropped, a window of 0 or an unknown rope type likewise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.numpy import load_file, save_file

import entity
from entity.families import FAMILIES
from entity.hf.config import HFModelConfig
from lucy.cli import run
from poly.errors import (
    ConfigError,
    GGUFFormatError,
    PolyError,
    UnsupportedError,
    WeightMappingError,
)
from tests.family_helpers import assert_load_error, converter_root, gguf_edit
from tests.hf_fixtures import make_tiny_checkpoint, set_config_keys

WAVY = {"rope_type": "wavy", "rope_theta": 10000.0, "factor": 2.0}
WINDOWED = [mt for mt, f in FAMILIES.items() if f.sliding != "none"]


def _config(model_type: str, **changes) -> dict:
    """transformers' config of `model_type` (tiny sizes, ids in the vocabulary) as config.json
    holds it, with `changes` applied."""
    import transformers

    ids = {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0}
    cfg = transformers.AutoConfig.for_model(
        model_type, vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **ids,
    )  # fmt: skip
    out = json.loads(cfg.to_json_string())
    out["architectures"] = [FAMILIES[model_type].causal_lm_class]
    return out | changes


def _error(config: dict) -> PolyError:
    with pytest.raises(PolyError) as info:
        HFModelConfig.parse(config).to_transformer_config()
    assert "\n" not in str(info.value)
    return info.value


def test_the_unbroken_configs_load():
    """The baseline: each family's transformers config is accepted as it is."""
    for mt in FAMILIES:
        HFModelConfig.parse(_config(mt)).to_transformer_config()


@pytest.mark.parametrize("model_type", WINDOWED)
def test_a_zero_sliding_window_names_the_key(model_type):
    err = _error(_config(model_type, sliding_window=0, use_sliding_window=True))
    assert isinstance(err, ConfigError) and err.exit_code == 4
    assert "sliding_window" in str(err)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_an_unknown_rope_type_names_it(model_type):
    err = _error(_config(model_type, rope_parameters=WAVY, rope_scaling=None))
    assert isinstance(err, UnsupportedError) and err.exit_code == 5
    assert "'wavy'" in str(err)


# --- through the CLI, on a real checkpoint ----------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bad_input") / "hf", "gpt_oss", seed=3)


def _no_sinks(path: Path) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


BREAKS = {
    "missing_sinks": (_no_sinks, WeightMappingError, "model.layers.1.self_attn.sinks", 4),
    "window_0": (lambda p: set_config_keys(p, sliding_window=0), ConfigError, "sliding_window", 4),
    "wavy_rope": (lambda p: set_config_keys(p, rope_parameters=WAVY), UnsupportedError, "'wavy'",
                  5),
}  # fmt: skip


@pytest.fixture(params=list(BREAKS))
def broken(request, gpt_oss, tmp_path):
    brk, cls, key, code = BREAKS[request.param]
    path = Path(shutil.copytree(gpt_oss, tmp_path / "m"))
    brk(path)
    return path, cls, key, code


def _one_line(err: str) -> str:
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("lucy: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_the_checkpoint_loads_before_it_is_broken(gpt_oss):
    assert entity.load(gpt_oss).config.attention.sinks


def test_the_library_error_is_typed(broken):
    path, cls, key, _ = broken
    assert_load_error(path, cls, key)


@pytest.mark.parametrize("command", ["convert", "generate"])
def test_the_cli_prints_one_line_and_the_exit_code(broken, capfd, tmp_path, command):
    path, _, key, code = broken
    if command == "convert":
        argv = ["convert", str(path), "-o", str(tmp_path / "out.entity"), "--quant", "f32"]
    else:
        argv = ["generate", str(path), "--prompt", "Hello", "--greedy", "--max-tokens", "4"]
    got = run(argv)
    _, err = capfd.readouterr()
    assert key in _one_line(err)
    assert got == code
    assert not (tmp_path / "out.entity").exists()


# --- GGUF files from llama.cpp's own converter, edited -------------------------------------------
@pytest.mark.slow
def test_bad_gguf_files_name_the_key(gpt_oss, tmp_path):
    from benchmarks import llama_convert

    root = converter_root()
    good = llama_convert.convert(gpt_oss, tmp_path / "g.gguf", "f32", root)
    assert entity.load(good).config.attention.sinks
    cases = [
        (gguf_edit(good, tmp_path / "a.gguf", drop=["blk.1.attn_sinks.weight"]), WeightMappingError,
         "missing tensor 'blk.1.attn_sinks.weight'"),
        (gguf_edit(good, tmp_path / "b.gguf", meta={"gpt-oss.attention.sliding_window": 0}),
         GGUFFormatError, "sliding_window"),
        (gguf_edit(good, tmp_path / "c.gguf", meta={"gpt-oss.rope.scaling.type": "wavy"}),
         UnsupportedError, "'wavy'"),
    ]  # fmt: skip
    for path, cls, key in cases:
        assert_load_error(path, cls, key)

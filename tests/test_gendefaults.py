"""Generation settings travel with the model (#13): HF generation_config.json -> .entity header
-> ``model.generation_defaults``; one rule everywhere: explicit > model file > fallback."""

from __future__ import annotations

import json

import pytest
from gguf.constants import GGMLQuantizationType as T

import entity
from entity.dotentity.container import EntityFile
from entity.dotentity.write import model_blocks, model_meta, write_entity
from poly.errors import EntityFormatError, SamplingParamsError
from poly.text.gendefaults import FALLBACK, MODEL_FILE, GenerationDefaults, defaults_of, resolve
from poly.text.sampling import GenOptions
from tests.hf_fixtures import make_tiny_checkpoint
from tests.test_native_blocks import KINDS, write_tiny_gguf

SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20,
            "repetition_penalty": 1.1, "max_new_tokens": 50}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    sampled = make_tiny_checkpoint(root / "sampled", "llama", generation=SAMPLING)
    greedy = make_tiny_checkpoint(root / "greedy", "llama")  # HF: no do_sample = greedy
    bare = make_tiny_checkpoint(root / "bare", "llama")
    (bare / "generation_config.json").unlink()
    return {"sampled": sampled, "greedy": greedy, "bare": bare}


def _hf_config(path):
    from transformers import GenerationConfig

    return GenerationConfig.from_pretrained(str(path))


def test_hf_generation_config_as_transformers_reads_it(hf_dirs):
    ref = _hf_config(hf_dirs["sampled"])
    d = entity.load(hf_dirs["sampled"]).generation_defaults
    assert d.source == MODEL_FILE
    o = d.options
    assert (o.temperature, o.top_p, o.top_k) == (ref.temperature, ref.top_p, ref.top_k)
    assert (o.repetition_penalty, o.max_tokens) == (ref.repetition_penalty, ref.max_new_tokens)
    assert ref.do_sample and not o.greedy


def test_hf_without_do_sample_is_greedy_from_the_model_file(hf_dirs):
    assert not _hf_config(hf_dirs["greedy"]).do_sample
    d = entity.load(hf_dirs["greedy"]).generation_defaults
    assert d.source == MODEL_FILE and d.options.greedy
    assert d.origin("temperature") == MODEL_FILE and d.origin("top_k") == FALLBACK


def test_hf_without_generation_config_uses_the_fallback(hf_dirs):
    d = entity.load(hf_dirs["bare"]).generation_defaults
    assert d.source == FALLBACK and d.settings == {} and d.options == GenOptions()


@pytest.mark.parametrize("name", ["sampled", "greedy", "bare"])
def test_settings_survive_conversion(hf_dirs, tmp_path, name):
    out = tmp_path / "m.entity"
    entity.convert(hf_dirs[name], out, quant="f32", verify=True)
    assert entity.load(out).generation_defaults == entity.load(hf_dirs[name]).generation_defaults
    # only the model's own settings are stored, under GenOptions names
    stored = EntityFile(out).meta("generation_config")
    assert stored == dict(entity.load(hf_dirs[name]).generation_defaults.settings)


def test_gguf_has_none_and_convert_can_add_them(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_tiny_gguf(gguf, kinds={k: T.Q8_0 for k in KINDS})
    assert entity.load(gguf).generation_defaults == GenerationDefaults()
    plain, greedy = tmp_path / "plain.entity", tmp_path / "greedy.entity"
    entity.convert(gguf, plain, quant="q8")
    assert entity.load(plain).generation_defaults.source == FALLBACK
    entity.convert(gguf, greedy, quant="q8", generation={"temperature": 0.0}, verify=True)
    d = entity.load(greedy).generation_defaults
    assert (d.source, dict(d.settings)) == (MODEL_FILE, {"temperature": 0.0})
    with pytest.raises(SamplingParamsError, match="temperature"):
        entity.convert(gguf, tmp_path / "bad.entity", generation={"temperature": -1})
    with pytest.raises(SamplingParamsError, match="seed"):
        entity.convert(gguf, tmp_path / "bad.entity", generation={"seed": 3})


def _write_with(tf, out, gen):
    """The model as an .entity whose header holds ``gen`` as its generation_config."""
    import numpy as np

    meta = dict(model_meta(tf), generation_config=gen)
    final = np.asarray(tf.final_norm, np.float32)
    glob = lambda: (tf.embeddings, None if tf.tied else tf.lm_head, final)  # noqa: E731
    write_entity(out, tf.config, model_blocks(tf), glob, meta, quant="f32")


def test_older_files_keep_loading(hf_dirs, tmp_path):
    """Older writers stored every GenOptions field (seed None, lists for tuples) or {}."""
    tf = entity.load(hf_dirs["sampled"])
    full = json.loads(json.dumps({**GenOptions().__dict__, "temperature": 0.6, "top_k": 20}))
    cases = {"full": (full, MODEL_FILE), "empty": ({}, FALLBACK),
             "newer": ({"temperature": 0.3, "typical_p": 0.5}, MODEL_FILE)}  # fmt: skip
    for name, (gen, source) in cases.items():
        out = tmp_path / f"{name}.entity"
        _write_with(tf, out, gen)
        d = entity.load(out).generation_defaults
        assert d.source == source, name
        assert d.options.temperature == gen.get("temperature", GenOptions().temperature)
    bad = tmp_path / "bad.entity"
    _write_with(tf, bad, {"top_p": 2.0})
    with pytest.raises(EntityFormatError, match="generation_config.*top_p"):
        entity.load(bad)


def test_the_one_rule():
    class M:
        generation_defaults = GenerationDefaults({"temperature": 0.0, "max_tokens": 64}, MODEL_FILE)

    r = resolve(M(), overrides={"max_tokens": 8, "seed": 3}, label="flag")
    assert (r.options.temperature, r.options.max_tokens, r.options.seed) == (0.0, 8, 3)
    assert r.origins["temperature"] == MODEL_FILE
    assert r.origins["max_tokens"] == r.origins["seed"] == "flag"
    assert r.origins["top_k"] == FALLBACK and r.options.top_k == GenOptions().top_k
    shown = {n: (v, o) for n, v, o in r.shown()}
    assert shown["temperature"] == (0.0, MODEL_FILE) and shown["seed"] == (3, "flag")
    # a whole options object is explicit in every field
    whole = resolve(M(), GenOptions(temperature=0.5))
    assert whole.options.temperature == 0.5 and set(whole.origins.values()) == {"argument"}
    # a model without a record (built in memory) runs with the fallback
    assert defaults_of(object()) == GenerationDefaults()
    assert resolve(object()).options == GenOptions()
    with pytest.raises(SamplingParamsError, match="tempreature"):
        resolve(M(), overrides={"tempreature": 1.0})


def test_lucy_verbose_names_where_each_setting_came_from(tmp_path):
    import os
    import subprocess
    import sys

    gguf, ent = tmp_path / "m.gguf", tmp_path / "m.entity"
    write_tiny_gguf(gguf, kinds={k: T.Q8_0 for k in KINDS})
    entity.convert(gguf, ent, quant="q8", generation={"temperature": 0.0, "max_tokens": 64})
    env = {**os.environ, "POLY_HOME": str(tmp_path / "home")}

    def settings_line(path, *flags):
        proc = subprocess.run(
            [sys.executable, "-m", "lucy", "generate", str(path), "--prompt", "hi", "--verbose",
             *flags], env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return [ln for ln in proc.stderr.splitlines() if ln.startswith("settings: ")]

    # the knobs past top_p only when set (the rest are off: the fallback's)
    assert settings_line(ent, "--max-tokens", "3") == [
        "settings: temperature=0.0 (model file) · top_k=40 (fallback) · top_p=1.0 (fallback) · "
        "max_tokens=3 (flag) · seed=None (fallback)"
    ]
    assert settings_line(gguf, "--max-tokens", "3", "--seed", "5", "--dry-multiplier", "0.5") == [
        "settings: temperature=0.7 (fallback) · top_k=40 (fallback) · top_p=1.0 (fallback) · "
        "dry_multiplier=0.5 (flag) · max_tokens=3 (flag) · seed=5 (flag)"
    ]


def test_library_and_session_follow_the_model_file(tmp_path):
    from poly.text.prompting import resolve_options
    from poly.text.session import ChatSession

    gguf, ent = tmp_path / "m.gguf", tmp_path / "m.entity"
    write_tiny_gguf(gguf, kinds={k: T.Q8_0 for k in KINDS})
    entity.convert(gguf, ent, quant="q8", generation={"temperature": 0.0, "max_tokens": 5})
    model = entity.load(ent)
    opts = resolve_options(model, None, {"seed": 1})  # what model.generate/stream run with
    assert (opts.temperature, opts.max_tokens, opts.seed) == (0.0, 5, 1)
    runs = {tuple(model.generate([1, 2, 3], seed=s).tokens) for s in range(4)}
    assert len(runs) == 1 and len(next(iter(runs))) <= 5  # greedy, the file's max_tokens
    session = ChatSession(model, top_k=7)
    assert session.options.temperature == 0.0 and session.options.top_k == 7
    assert session.resolved.origins["temperature"] == MODEL_FILE
    assert session.resolved.origins["top_k"] == "argument"
    session.set_option("temperature", 0.5)
    assert session.resolved.origins["temperature"] == "/set" and session.options.temperature == 0.5
    plain = ChatSession(entity.load(gguf))
    assert plain.options == GenOptions() and plain.resolved.origins["temperature"] == FALLBACK


@pytest.mark.parametrize("name", ["sampled", "greedy", "bare"])
def test_server_requests_default_to_what_lucy_generate_runs_with(hf_dirs, name):
    """A request that leaves the sampling knobs out gets the settings `lucy generate --verbose`
    reports for the same model (model file > fallback); a request's own fields still win."""
    import os
    import subprocess
    import sys

    from lucy.server.protocol import model_defaults, parse_chat

    proc = subprocess.run(
        [sys.executable, "-m", "lucy", "generate", str(hf_dirs[name]), "--prompt", "hi",
         "--verbose", "--max-tokens", "2"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "POLY_HOME": str(hf_dirs[name].parent / "home")},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("settings: "))
    cli = dict(part.split(" (")[0].split("=") for part in line[len("settings: ") :].split(" · "))
    model = entity.load(hf_dirs[name])
    params = parse_chat({"messages": [{"role": "user", "content": "hi"}]}, model_defaults(model))
    params = params.params
    for knob in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "dry_multiplier"):
        shown = cli.get(knob, getattr(GenOptions(), knob))  # not shown: the fallback's
        assert float(shown) == float(getattr(params, knob)), knob
    file_max = model.generation_defaults.settings.get("max_tokens")
    assert params.max_tokens == file_max  # None (to the context end) unless the file sets it
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.3, "top_k": 3}
    explicit = parse_chat(body, model_defaults(model)).params
    assert (explicit.temperature, explicit.top_k) == (1.3, 3)

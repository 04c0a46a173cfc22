"""#55 item 4: one behaviour per model whatever its file. SmolLM2-135M-Instruct as the GGUF, as
the user's own conversion of it, as the demo's `.entity`, as an HF snapshot and served resolves
the same generation settings (poly.text.known_models), and `lucy generate --verbose` /
`lucy serve --verbose` print them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import entity
from poly.text.gendefaults import FALLBACK, KNOWN_MODEL, MODEL_FILE, defaults_of, resolve
from poly.text.known_models import KNOWN_MODELS, identify
from poly.text.sampling import GenOptions
from tests.serve_helpers import env, post, running_server

pytestmark = pytest.mark.real_model
SMOLLM2 = next(k for k in KNOWN_MODELS if k.name == "SmolLM2-135M-Instruct")
PROMPT = "Write a short poem about the sea."


@pytest.fixture(scope="module")
def files(smollm2_gguf, tmp_path_factory):
    """The GGUF, the user's own `lucy convert` of it, and the demo's conversion (its settings in
    the header, as `lucy demo` makes it)."""
    from entity.smollm2 import DEMO_GENERATION

    root = tmp_path_factory.mktemp("known")
    own, demo = root / "own.entity", root / "demo.entity"
    subprocess.run([sys.executable, "-m", "lucy", "convert", str(smollm2_gguf), "-o", str(own)],
                   env=env(), check=True, capture_output=True, timeout=900)  # fmt: skip
    entity.convert(smollm2_gguf, demo, quant="q4", generation=DEMO_GENERATION)
    return {"gguf": smollm2_gguf, "own": own, "demo": demo}


def _verbose(path) -> dict[str, str]:
    """name -> value of the `settings:` line of `lucy generate --verbose` (no sampling flags)."""
    proc = subprocess.run(
        [sys.executable, "-m", "lucy", "generate", str(path), "--prompt", "hi", "--chat",
         "--max-tokens", "2", "--verbose"], env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("settings: "))
    return _parse(line[len("settings: ") :])


def _parse(text: str) -> dict[str, str]:
    pairs = (part.split(" (")[0].split("=") for part in text.split(" · "))
    return {k: v for k, v in pairs if k not in ("max_tokens", "seed")}


def test_every_file_of_the_model_resolves_the_table_entry(files):
    want = GenOptions(**SMOLLM2.settings)
    for name, path in files.items():
        model = entity.load(path)
        assert identify(model.config, model.tokenizer) is SMOLLM2, name
        d = defaults_of(model)
        got = d.options
        for knob in SMOLLM2.settings:
            assert getattr(got, knob) == getattr(want, knob), (name, knob)
        # the GGUF and the user's conversion carry nothing: the table fills in (before: 0.7)
        origin = MODEL_FILE if name == "demo" else KNOWN_MODEL
        assert d.origin("dry_multiplier") == origin, name
        assert d.origin("top_k") == FALLBACK
    assert dict(entity.load(files["own"]).generation_defaults.settings) == {}  # none stored


def test_hf_snapshot_of_the_model_gets_the_same_settings(smollm2_hf_dir, files):
    hf = resolve(entity.load(smollm2_hf_dir)).options
    gguf = resolve(entity.load(files["gguf"])).options
    assert hf == gguf


def test_same_shape_alone_is_not_enough(files, tmp_path):
    """The identity is shape + vocabulary: another tokenizer on the same shape is unknown."""
    from gguf.constants import GGMLQuantizationType as T

    from tests.test_native_blocks import KINDS, write_tiny_gguf

    write_tiny_gguf(tmp_path / "t.gguf", kinds={k: T.Q8_0 for k in KINDS})
    other = entity.load(tmp_path / "t.gguf").tokenizer
    config = entity.load(files["gguf"]).config
    assert identify(config, other) is None and identify(config, None) is None


@pytest.mark.slow  # four lucy processes and a server: ~60 s on 2 shared cores
def test_lucy_verbose_prints_the_same_settings_for_each_file_and_the_server(files):
    lines = {name: _verbose(path) for name, path in files.items()}
    assert lines["gguf"] == lines["own"] == lines["demo"], lines
    assert lines["gguf"]["temperature"] != "0.7"  # before #55: the fallback on the GGUF
    with running_server(files["gguf"], "--verbose") as (base, proc):
        served = None
        for _ in range(40):  # the settings line comes before the listening banner
            line = proc.stderr.readline().decode()
            if "settings: " in line:
                served = _parse(line.split("settings: ", 1)[1].strip())
                break
        assert served == lines["gguf"]
        body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48}
        status, reply = post(base + "/v1/chat/completions", _json(body), timeout=600)
        assert status == 200, reply
    # a request without sampling fields decodes as `lucy generate` does on the same file
    model = entity.load(files["gguf"])
    local = model.generate(PROMPT, chat=True, max_tokens=48).text
    assert reply["choices"][0]["message"]["content"] == local


def _json(body) -> bytes:
    import json

    return json.dumps(body).encode()

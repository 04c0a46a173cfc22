"""The one `.entity` naming rule (entity.paths) shared by convert, `lucy demo` and the menu."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from gguf.constants import GGMLQuantizationType as T

from entity.paths import entities_dir, entity_filename, models_dir, poly_home
from tests.test_native_blocks import KINDS, write_tiny_gguf


@pytest.mark.parametrize(
    ("source", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.q4.entity"),
        ("/x/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.q4.entity"),
        ("qwen2.5-0.5b-instruct-q4_k_m.gguf", "qwen2.5-0.5b-instruct.q4.entity"),
        ("Llama-3.2-1B-Instruct-F16.gguf", "Llama-3.2-1B-Instruct.q4.entity"),
        ("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB--SmolLM2-135M.q4.entity"),
        ("/hub/models--org--name/snapshots/abc123", "org--name.q4.entity"),
        ("/e/SmolLM2-135M-Instruct.q8.entity", "SmolLM2-135M-Instruct.q4.entity"),
    ],
)
def test_entity_filename(source, name):
    assert entity_filename(source, "q4") == name


def test_dirs_follow_poly_home(monkeypatch, tmp_path):
    monkeypatch.setenv("POLY_HOME", str(tmp_path))
    assert poly_home() == tmp_path
    assert models_dir() == tmp_path / "models" and entities_dir() == tmp_path / "entities"


def _lucy(env, *args):
    cmd = [sys.executable, "-m", "lucy", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_demo_and_convert_name_a_model_alike(monkeypatch, tmp_path):
    """#13: `lucy models` listed the demo's file and convert's file of one model under two names."""
    from lucy import actions, terminal

    home = tmp_path / "poly"
    (home / "models").mkdir(parents=True)
    gguf = home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # where the demo keeps it
    write_tiny_gguf(gguf, kinds={k: T.Q4_1 for k in KINDS})
    monkeypatch.setenv("POLY_HOME", str(home))
    demo = actions.demo_entity(
        terminal.make_console()
    )  # the GGUF is already in models/: no download
    env = {**os.environ, "POLY_HOME": str(home), "HF_HUB_CACHE": str(tmp_path / "hub"),
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}  # fmt: skip
    again = _lucy(env, "convert", str(gguf), "--quant", "q4")  # convert's default output
    assert again.returncode != 0 and str(demo) in again.stderr  # the demo's own file
    q8 = _lucy(env, "convert", str(gguf), "--quant", "q8", "--verify")
    assert q8.returncode == 0, q8.stderr
    note = ("note: precision cannot exceed the source: the q8 file holds the values of its Q4_1 "
            "blocks, re-encoded as q8")  # fmt: skip
    assert note in q8.stdout.splitlines()  # #13: said in one line, never silently
    listed = _lucy(env, "models", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    entities = [r for r in rows if r["kind"] == "entity"]  # the source GGUF is listed too
    assert sorted(r["name"] for r in entities) == [
        "SmolLM2-135M-Instruct.q4",
        "SmolLM2-135M-Instruct.q8",
    ]
    assert sorted(r["dtype"] for r in entities) == ["q4", "q8"]
    assert [r["path"] for r in rows if r["kind"] == "gguf"] == [str(gguf)]


@pytest.mark.parametrize("quant", ["q4", "q8", "f32"])
def test_menu_catalogue_looks_where_convert_writes(monkeypatch, tmp_path, quant):
    """The menu's `.entity` column and "[a] all missing" check the file `lucy convert` writes."""
    from entity.convert import default_output
    from lucy import catalogue

    monkeypatch.setenv("POLY_HOME", str(tmp_path / "poly"))
    snap = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    row = catalogue.ModelRow(name="HuggingFaceTB/SmolLM2-135M", kind="hf", path=str(snap))
    want = tmp_path / "poly" / "entities" / f"HuggingFaceTB--SmolLM2-135M.{quant}.entity"
    assert catalogue.entity_path(row, quant) == default_output(snap, quant) == want
    assert default_output("HuggingFaceTB/SmolLM2-135M", quant) == want  # by model id too

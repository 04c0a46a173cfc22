"""The code blocks of the docs run as written: docs/build-by-hand.md and docs/architecture.md's
Python, and every `lucy` command of README.md and docs/*.md (with the output they show)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def test_build_by_hand_guide_runs():
    text = (Path(__file__).parent.parent / "docs" / "build-by-hand.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    scope: dict = {}
    for code in blocks:
        exec(compile(code, "build-by-hand.md", "exec"), scope)  # noqa: S102 (our own docs)
    assert scope["y"].shape == (5, 64) and scope["y2"].shape == (1, 64)
    assert scope["out"].shape == (3, 64) and scope["out8"].dtype == np.float32
    assert scope["logits"].shape == (1000,) and scope["logits"].dtype == np.float32


def test_architecture_adding_a_layer_kind_runs():
    text = (Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    scope: dict = {}
    exec(compile(blocks[0], "architecture.md", "exec"), scope)  # noqa: S102 (our own docs)
    layer = scope["layer"]
    assert layer.weights.versions[layer.weights.active]["w"].scheme == "int8"
    assert scope["y"].shape == (2, 8) and scope["y"].dtype == np.float32


# --- every `lucy` command of README.md and docs/*.md runs as written ----------------------------
#
# Commands are the lines of ```bash blocks and the `$ ` lines of ```console blocks that call lucy;
# a console command's following lines are its expected output: `...` stands for any text (a line
# of only `...` for any lines), a decimal before a unit (tok/s, s, MB) for any number. They run
# with bash in a fresh HOME where `lucy demo` has fetched (here: linked) and converted its model,
# so `~/.cache/poly/...` paths are the ones a user has after the demo.

ROOT = Path(__file__).parent.parent
FENCE = re.compile(r"^```(bash|console)\n(.*?)^```", re.S | re.M)
CALLS_LUCY = re.compile(r"(^|[|&;]\s*|^(\w+=\S*\s+)+|-m )lucy\b")
TIMING = re.compile(r"\d+\.\d+(?= ?(tok/s|s|MB|GB|KB)\b)")
# Commands not run here, by prefix, each with the reason and where else it is covered.
EXEMPT = {
    "mpiexec": "needs MPI ranks; tests/test_tp.py runs lucy --tp under mpiexec",
    "lucy serve": "runs until stopped; tests/test_serve*.py start the real server and query it",
    "lucy download Qwen/": "needs the network; its offline form (HF_HUB_OFFLINE=1) is run",
}


def _commands(lang: str, body: str):
    """(command, expected output lines or None) for each lucy call of one block."""
    lines = body.replace("\\\n", " ").splitlines()
    if lang == "bash":
        for line in lines:
            line = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            for part in line.split(" && "):  # `pip install ... && lucy demo`: the lucy part
                if CALLS_LUCY.search(part.strip()):
                    yield part.strip(), None
        return
    i = 0
    while i < len(lines):
        j = i + 1
        while j < len(lines) and not lines[j].startswith("$ "):
            j += 1
        if lines[i].startswith("$ ") and CALLS_LUCY.search(lines[i][2:]):
            yield lines[i][2:].strip(), lines[i + 1 : j]
        i = j


def doc_examples() -> list:
    out = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for lang, body in FENCE.findall(md.read_text()):
            for cmd, expected in _commands(lang, body):
                reason = next((r for p, r in EXEMPT.items() if cmd.startswith(p)), None)
                marks = [pytest.mark.skip(reason=f"exempt: {reason}")] if reason else []
                out.append(pytest.param(cmd, expected, id=f"{md.name}:{cmd[:60]}", marks=marks))
    return out


def _pattern(expected: list[str], one_line: bool) -> re.Pattern:
    lines = [ln.rstrip() for ln in expected]
    if one_line:  # a JSON object wrapped for reading: one line on stdout
        lines = [" ".join(ln.strip() for ln in lines)]
    parts = []
    for line in lines:
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?[^\n]*")
            continue
        parts.append(".*?".join(_literal(piece) for piece in line.split("...")))
    return re.compile("\n".join(parts))


def _literal(text: str) -> str:
    """`text` as a regex that matches itself, a timing in it matching any number."""
    out, pos = [], 0
    for m in TIMING.finditer(text):
        out += [re.escape(text[pos : m.start()]), r"\d+(?:\.\d+)?"]
        pos = m.end()
    return "".join(out) + re.escape(text[pos:])


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory, smollm2_gguf):
    """A HOME after `lucy demo`: the GGUF in ~/.cache/poly/models (linked to the real one, as the
    demo's pip fetch would put it) and the .entity the demo converts; an empty HF cache."""
    home = tmp_path_factory.mktemp("home")
    models = home / ".cache" / "poly" / "models"
    models.mkdir(parents=True)
    (models / smollm2_gguf.name).symlink_to(smollm2_gguf)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POLY_", "HF_"))}
    env.update(
        HOME=str(home),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        NO_COLOR="1",
        COLUMNS="160",
    )
    proc = subprocess.run(["lucy", "demo"], env=env, input="", capture_output=True, text=True,
                          timeout=600, cwd=home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {"home": home, "env": env}


def test_docs_examples_are_found():
    cmds = [p.values[0] for p in doc_examples()]
    assert any(c.startswith("lucy demo") for c in cmds)  # README's set-up line
    assert sum(c.startswith("lucy ") for c in cmds) >= 10
    assert not [c for c in cmds if re.search(r"\b(model|smol)\.(gguf|entity)\b", c)], cmds


@pytest.mark.slow
@pytest.mark.parametrize("cmd, expected", doc_examples())
def test_docs_command_runs_as_written(demo_home, cmd, expected):
    proc = subprocess.run(["bash", "-c", cmd], env=demo_home["env"], input="",
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600, cwd=demo_home["home"])  # fmt: skip
    out = "\n".join(ln.rstrip() for ln in proc.stdout.strip("\n").splitlines())
    assert "Traceback" not in out, out[-3000:]
    shows_error = any(ln.startswith("lucy: error:") for ln in expected or ())
    if shows_error:
        assert proc.returncode not in (0, 1), out  # a typed error's documented code
    else:
        assert proc.returncode == 0, out[-3000:]
    if expected:
        text = "\n".join(expected).strip("\n").splitlines()
        pattern = _pattern(text, one_line=len(out.splitlines()) == 1 and len(text) > 1)
        assert pattern.fullmatch(out), f"documented:\n{chr(10).join(text)}\n\nprinted:\n{out}"

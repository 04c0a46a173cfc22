"""The distribution's name: free on PyPI or ours there, and the name every install hint gives.

PyPI's `poly` is an unrelated 2007 project: the hints that named it with an extra (mpi, serve,
fast, bench) installed someone else's code. The hints are found by grep over the code, the docs
and .ci/run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", "build", "dist", "node_modules", "__pycache__", "results"}
IMPORT_NAMES = ("poly", "entity", "lucy")
# a requirement with extras: name[extra,...], quoted or not
REQ = re.compile(r"""(?<![\w./-])([A-Za-z0-9][\w.-]*)\[([\w,\s-]+)\]""")


def project_table() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return text.split("[project]", 1)[1].split("\n[", 1)[0]


def dist_name() -> str:
    return re.search(r'^name = "([^"]+)"', project_table(), re.M).group(1)


def extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w[\w-]*) = \[", table, re.M))


def hint_files() -> list[Path]:
    found = [ROOT / ".ci" / "run"]
    for path in ROOT.rglob("*"):
        if path.suffix in (".py", ".md") and not SKIP_DIRS & set(path.relative_to(ROOT).parts):
            if not any(p.startswith(".") and p != ".ci" for p in path.relative_to(ROOT).parts):
                found.append(path)
    return found


def hints() -> list[tuple[str, str]]:
    """(file:line, text after `pip install` up to a comment or the end of the line)."""
    out = []
    for path in hint_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in re.finditer(r"pip install\b(.*)", line):
                rest = re.split(r" #|&&|;|\||`|\)", m.group(1))[0]  # this command only
                out.append((f"{path.relative_to(ROOT)}:{n}", rest))
    return out


def test_every_install_hint_names_this_distribution():
    name, known = dist_name(), extras()
    wrong = []
    for where, rest in hints():
        for req, wanted in REQ.findall(rest):
            asked = {e.strip() for e in wanted.split(",")}
            if req != name or not asked <= known:
                wrong.append(f"{where}: {req}[{wanted}]")
        # a bare import name (poly, entity, lucy) names a distribution that is not ours
        if re.search(rf"""(?<![\w./-])['"]?({"|".join(IMPORT_NAMES)})['"]?(?![\w.\[/-])""", rest):
            wrong.append(f"{where}: {rest.strip()}")
    assert len(hints()) >= 8  # the grep found the hints (README, docs, lucy's messages)
    assert not wrong, f"hints that do not install {name}: {wrong}"


def test_distribution_name_is_free_on_pypi_or_ours():
    name = dist_name()
    try:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=20) as resp:
            info = json.load(resp)["info"]
    except urllib.error.HTTPError as err:
        assert err.code == 404, err  # 404: nobody has the name
        return
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        pytest.skip(f"PyPI not reachable: {err}")
    ours = re.search(r'^description = "([^"]+)"', project_table(), re.M).group(1)
    assert info["summary"] == ours, f"PyPI's {name!r} is someone else's: {info['summary']!r}"


def test_pip_resolves_the_checkout_with_extras_to_this_distribution(tmp_path):
    """`pip install --dry-run --no-deps './[mpi]'` names the distribution and poly's version."""
    import poly

    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet"]
    cmd += ["--no-build-isolation", "--ignore-installed", "--report", str(report), f"{ROOT}[mpi]"]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True, cwd=tmp_path)
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["name"] == dist_name() == "polyloom"
    assert item["metadata"]["version"] == poly.__version__
    assert "mpi" in item["metadata"]["provides_extra"]

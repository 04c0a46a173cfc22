"""The release (.ci/release) and the C build's progress, each a real build (slow).

The wheel is installed into a fresh venv whose PATH has no compiler (CC=/bin/false): it must
run `lucy --version` and generate on the C kernels it carries, greedy tokens equal to
transformers'. The build's progress must reach the terminal although pip hides its output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import poly
from tests.hf_fixtures import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(sys.platform != "linux", reason="the release wheel is Linux x86-64"),
]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([str(ROOT / ".ci" / "release"), str(out)], check=True, timeout=1500)
    return out


def no_compiler_env(venv: Path, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POLY_", "VIRTUAL_ENV"))}
    env.update(PATH=str(venv / "bin"), CC="/bin/false", HOME=str(home), POLY_HOME=str(home))
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(home / "hf"), POLY_BACKEND="c", NO_COLOR="1")
    return env


def test_release_wheel_runs_without_a_compiler(release, tmp_path):
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    (wheel,) = release.glob("*.whl")
    assert re.search(r"^polyloom-.*-manylinux_\d+_\d+_x86_64.*\.whl$", wheel.name), wheel.name
    assert list(release.glob("polyloom-*.tar.gz"))
    names = zipfile.ZipFile(wheel).namelist()
    (ext,) = [n for n in names if n.startswith("poly/runtime/native/ckernels.")]
    assert any("libgomp" in n for n in names), "auditwheel did not vendor OpenMP"
    so = tmp_path / "ckernels.so"
    so.write_bytes(zipfile.ZipFile(wheel).read(ext))
    if shutil.which("objdump"):  # the AVX-512 build is in, though this CPU may not run it
        asm = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True).stdout
        assert "%zmm" in asm and "vpdpbusd" in asm

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = no_compiler_env(venv, tmp_path)
    assert (
        shutil.which("gcc", path=env["PATH"]) is None
        and shutil.which("cc", path=env["PATH"]) is None
    )
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], check=True, env=env, timeout=900)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
        )

    proc = run(str(venv / "bin" / "lucy"), "--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"lucy {poly.__version__} (polyloom)"
    isas = run(py, "-c", "import poly.runtime.native.ckernels as c; print(*c.ISAS)")
    from poly.runtime.native import ckernels  # the in-place build: every build this CPU runs

    assert isas.stdout.split() == list(ckernels.ISAS), isas.stderr

    src = make_tiny_checkpoint(tmp_path / "tiny", "llama", seed=3)
    prompt = "hello there, how are"
    cmd = [str(venv / "bin" / "lucy"), "generate", str(src), "--prompt", prompt, "--greedy"]
    proc = run(*cmd, "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    ids = AutoTokenizer.from_pretrained(src)(prompt, add_special_tokens=False)["input_ids"]
    model = LlamaForCausalLM.from_pretrained(src)
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([ids]),
            max_new_tokens=len(res["tokens"]),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert len(res["tokens"]) == 8 and res["tokens"] == ref[0, len(ids) :].tolist()


def source_copy(dest: Path) -> Path:
    """The files a build reads, without build/ or any built extension (a cold build)."""
    ignore = shutil.ignore_patterns(".*", "build", "dist", "*.so", "*.egg-info", "__pycache__")
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("csrc", "poly", "entity", "lucy"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def pip_wheel_on_a_terminal(src: Path, out: Path, cache: Path) -> tuple[str, float]:
    """`pip wheel` (no -v: pip hides the build's output) on a pseudo-terminal: what it shows."""
    import pexpect

    # the base build alone (~10 s): the avx2/avx512 lines come from the same code, 4 min more
    env = {**os.environ, "POLY_BUILD_CACHE": str(cache), "POLY_BUILD_ISAS": "base"}
    env.pop("POLY_BUILD_RELEASE", None)
    args = ["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(out)]
    start = time.monotonic()
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=900)
    text = child.read()
    child.close()
    assert child.exitstatus == 0, text
    return text, time.monotonic() - start


def test_build_progress_shows_on_the_terminal_and_a_rebuild_reuses_it(tmp_path):
    src = source_copy(tmp_path)
    (tmp_path / "wh").mkdir()
    text, _ = pip_wheel_on_a_terminal(src, tmp_path / "wh", tmp_path / "cache")
    assert re.search(r"polyloom:\s+base\s+\d+\.\d s", text), text
    assert re.search(r"polyloom: C kernels built in \d+ s", text), text

    shutil.rmtree(src / "build")  # the same sources again in a fresh build dir: the cache's copy
    text, took = pip_wheel_on_a_terminal(src, tmp_path / "wh", tmp_path / "cache")
    assert "reused from" in text and "compiling" not in text, text
    assert took < 60, took

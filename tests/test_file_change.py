"""A model file changed on disk under a running process (issue 56 item 3): `cp other served`
truncates the same inode and rewrites it; a truncation alone leaves it short. With the weights
on a file mapping the next request died by SIGBUS (exit 135 / -7) or read the other file's
bytes; now the loaded model keeps working from its own memory, with the same greedy answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

CHILD = r"""
import sys, entity
tf = entity.load(sys.argv[1])
say = lambda: tf.generate("The capital of France is", max_tokens=8, temperature=0).text
print(repr(say()), flush=True)
sys.stdin.readline()  # the parent changes the file now
print(repr(say()), flush=True)
"""


def _run_across_change(path, change) -> subprocess.CompletedProcess:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        first = child.stdout.readline()
        change(path)
        out, err = child.communicate("go\n", timeout=120)
    finally:
        child.kill()
    return subprocess.CompletedProcess(child.args, child.returncode, first + out, err)


def _cp_over(other):
    def change(path):  # what cp does: O_TRUNC on the same inode, then the new bytes
        with open(other, "rb") as src, open(path, "r+b") as dst:
            dst.truncate(0)
            shutil.copyfileobj(src, dst)

    return change


@pytest.fixture(scope="module")
def smollm2_entity(smollm2_gguf, tmp_path_factory):
    from entity.convert import convert

    out = tmp_path_factory.mktemp("entity") / "m.entity"
    convert(smollm2_gguf, out, quant="q4")
    return out


@pytest.mark.parametrize("kind", ["gguf", pytest.param("entity", marks=pytest.mark.slow)])
@pytest.mark.parametrize("how", ["truncate", "cp"])
def test_file_changed_under_a_running_model(kind, how, smollm2_gguf, smollm2_entity, tmp_path):
    src = smollm2_gguf if kind == "gguf" else smollm2_entity
    served = tmp_path / src.name
    shutil.copy(src, served)
    other = smollm2_entity if kind == "gguf" else smollm2_gguf
    change = (lambda p: os.truncate(p, 0)) if how == "truncate" else _cp_over(other)
    res = _run_across_change(served, change)
    assert res.returncode == 0, f"child died ({res.returncode}): {res.stderr[-600:]}"
    before, after = res.stdout.splitlines()
    assert "Paris" in before and after == before  # same greedy answer off the model's own memory

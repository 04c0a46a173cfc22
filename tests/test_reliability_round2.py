"""Reliability round 2 (issue #18): one test (or more) per item, reproducing the reported input.

Bounds on memory are the peak RSS of a child process (`os.wait4`), generous for a loaded
machine; no test asserts a tight wall-clock time.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from entity.convert import convert
from poly.errors import OutputPathError
from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import make_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)


def run_child(
    argv: list[str], *, stdin: str = "", env: dict | None = None, timeout: float = 240
) -> tuple[int, str, str, int]:
    """Run ``argv`` in a child process: (exit code, stdout, stderr, peak RSS in MB of the child)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    with tempfile.TemporaryFile("w+") as fin, tempfile.TemporaryFile("w+") as fout:
        with tempfile.TemporaryFile("w+") as ferr:
            fin.write(stdin)
            fin.seek(0)
            p = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, env=full_env)
            deadline = time.monotonic() + timeout
            while True:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    p.kill()
                    os.wait4(p.pid, 0)
                    raise AssertionError(f"{argv} still running after {timeout} s")
                time.sleep(0.05)
            p.returncode = os.waitstatus_to_exitcode(status)
            fout.seek(0)
            ferr.seek(0)
            return p.returncode, fout.read(), ferr.read(), usage.ru_maxrss // 1024


def lucy(*args, **kw) -> tuple[int, str, str, int]:
    return run_child([sys.executable, "-m", "lucy", *map(str, args)], **kw)


def one_error_line(err: str) -> str:
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("lucy: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("r2src") / "llama", "llama")


# --- item 1: --force never overwrites a device, FIFO, socket or a symlink to one ------------------


def _specials(d: Path) -> dict[str, Path]:
    dev = d / "null"
    os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    fifo = d / "fifo"
    os.mkfifo(fifo)
    link = d / "link-to-dev"
    link.symlink_to(dev)
    return {"device": dev, "fifo": fifo, "symlink": link}


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_item1_force_never_overwrites_special_files(tiny_src, tmp_path):
    import socket

    paths = _specials(tmp_path)
    sock_path = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock_path))
    paths["socket"] = sock_path
    try:
        before = {k: os.lstat(p) for k, p in paths.items()}
        for kind, p in paths.items():
            exc = expect_error(
                lambda p=p: convert(tiny_src, p, quant="q4", force=True),
                OutputPathError,
                "bad_output_path",
            )
            assert "never overwritten" in str(exc), kind
            after = os.lstat(p)
            assert (after.st_mode, after.st_ino, after.st_rdev) == (
                before[kind].st_mode,
                before[kind].st_ino,
                before[kind].st_rdev,
            ), kind
        assert sorted(x.name for x in tmp_path.iterdir()) == sorted(x.name for x in paths.values())
        code, _, err, _ = lucy("convert", tiny_src, "-o", paths["device"], "--force")
        assert code == 9 and "character device" in one_error_line(err)
        assert stat.S_ISCHR(os.lstat(paths["device"]).st_mode)
    finally:
        s.close()

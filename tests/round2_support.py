"""Helpers of the round-2 reliability tests (issue #18): child processes with their peak RSS.

Peak RSS of a child is its VmHWM (per address space, reset by exec). ru_maxrss is not usable:
Linux carries the parent's high-water mark into a forked child across exec.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.fuzz import harness

REPO = Path(__file__).resolve().parents[1]
LONG = harness.EXAMPLES > harness.DEFAULT_EXAMPLES  # the fuzz suite's long mode
_HWM_WRAPPER = """
import atexit, runpy, sys
out, args = sys.argv[1], sys.argv[2:]
def _hwm():
    with open("/proc/self/status") as f:
        kb = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
    with open(out, "w") as f:
        f.write(str(kb))
atexit.register(_hwm)
if args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *args[2:]]
    exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
"""


def run_py(
    args: list, *, stdin: str = "", env: dict | None = None, timeout: float = 240
) -> tuple[int, str, str, int]:
    """``python *args`` in a child: (exit code, stdout, stderr, peak RSS in MB; -1 if unknown)."""
    full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    with tempfile.TemporaryDirectory() as d:
        hwm = Path(d) / "hwm"
        argv = [sys.executable, "-c", _HWM_WRAPPER, str(hwm), *map(str, args)]
        p = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, env=full_env, timeout=timeout
        )
        rss = int(hwm.read_text()) // 1024 if hwm.exists() else -1
    return p.returncode, p.stdout, p.stderr, rss


def lucy(*args, **kw) -> tuple[int, str, str, int]:
    return run_py(["-m", "lucy", *args], **kw)


def one_error_line(err: str) -> str:
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith("lucy: error: "), err
    return lines[0]

"""`lucy` shows a spinner on stderr while a model opens, on a terminal only: a pipe or a log gets
nothing (the first open of an 8B file writes its repacked layouts for tens of seconds)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = (
    "import time\nfrom lucy.terminal import opening\n"
    "with opening('m.gguf'):\n    time.sleep(0.3)\nprint('open')"
)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_terminal_sees_the_spinner_then_its_line_erased():
    main, sub = os.openpty()
    env = {**os.environ, "TERM": "xterm"}
    env.pop("COLUMNS", None)
    done = subprocess.run([sys.executable, "-c", CODE], stdin=sub, stdout=subprocess.PIPE,
                          stderr=sub, env=env, timeout=60)  # fmt: skip
    os.close(sub)
    drawn = os.read(main, 65536).decode("utf-8", "replace")
    os.close(main)
    assert done.returncode == 0 and done.stdout == b"open\n"
    assert "opening m.gguf" in drawn
    assert drawn.endswith("\x1b[2K")  # the spinner's line erased: nothing left on the screen


def test_a_pipe_gets_nothing():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout == b"open\n" and done.stderr == b""


WRITES = (
    "import sys, time\nfrom pathlib import Path\nfrom poly.runtime import cache_files\n"
    "from lucy.terminal import finish_cache_writes\n"
    "out = Path(sys.argv[1])\n"
    "cache_files.write_renamed_later(out, lambda f: (time.sleep(0.5), f.write(b'x')))\n"
    "finish_cache_writes()\n"
    "print(out.read_bytes().decode(), cache_files.pending())"
)


def test_the_exit_says_why_it_waits_for_the_layout_writes(tmp_path):
    """A first open hands its layouts to the cache writer; lucy's exit waits for them, saying
    so on a terminal (`finish_cache_writes`), and a pipe gets the file and no words."""
    done = subprocess.run([sys.executable, "-c", WRITES, str(tmp_path / "a")], capture_output=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout == b"x 0\n" and done.stderr == b""
    if not hasattr(os, "openpty"):
        return
    main, sub = os.openpty()
    done = subprocess.run([sys.executable, "-c", WRITES, str(tmp_path / "b")], stdin=sub,
                          stdout=subprocess.PIPE, stderr=sub, env={**os.environ, "TERM": "xterm"},
                          timeout=60)  # fmt: skip
    os.close(sub)
    drawn = os.read(main, 65536).decode("utf-8", "replace")
    os.close(main)
    assert done.stdout == b"x 0\n" and "writing the repacked layouts" in drawn

"""The cache writer (`poly.runtime.cache_files.write_renamed_later`): files written in order
after every `holding` block (a model's open) has ended, and a forked child starts afresh."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from poly.runtime import cache_files


def test_writes_wait_for_an_open_then_land(tmp_path):
    out = tmp_path / "a.bin"
    with cache_files.holding():
        cache_files.write_renamed_later(out, lambda f: f.write(b"layout"))
        assert cache_files.pending() == 1 and not out.exists()  # held while the open runs
    cache_files.flush()
    assert out.read_bytes() == b"layout" and cache_files.pending() == 0


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="needs fork")
def test_a_child_forked_during_an_open_writes_its_own(tmp_path):
    """The child inherits neither the worker nor the parent's open: its writes land."""
    out = tmp_path / "child.bin"
    with cache_files.holding():
        pid = os.fork()
        if pid == 0:  # the child: a hang here would be the parent's open held forever
            signal.alarm(20)
            cache_files.write_renamed_later(out, lambda f: f.write(b"child"))
            cache_files.flush()
            os._exit(0 if out.exists() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert out.read_bytes() == b"child"

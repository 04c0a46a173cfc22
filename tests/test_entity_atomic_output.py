"""`.entity` output is atomic (entity.atomic): an existing file is kept unless forced, the
input is never written over, a failure or an interrupt leaves no temp file, a full disk is a
typed error, and the temp files of dead writers are swept."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from entity.atomic import (
    atomic_output,
    check_output,
    open_locked_temp,
    sweep_stale_temps,
    temp_name,
)
from entity.dotentity.container import EntityFile, EntityWriter
from poly.errors import InsufficientSpaceError, OutputExistsError, OutputPathError
from tests.fuzz.corpus import ENTITY_ARRAYS, ENTITY_META


def _write(path, arrays, **kw) -> Path:
    w = EntityWriter(path, **kw)
    for name, arr in arrays.items():
        w.add(name, arr)
    return w.finish(dict(ENTITY_META))


@pytest.fixture
def small(tmp_path):
    return _write(tmp_path / "m.entity", ENTITY_ARRAYS), ENTITY_ARRAYS


def test_refuses_existing_output_unless_forced(small):
    path, arrays = small
    before = path.read_bytes()
    with pytest.raises(OutputExistsError):
        _write(path, arrays)
    assert path.read_bytes() == before
    _write(path, {"x": np.zeros(3, np.float32)}, force=True)
    assert list(EntityFile(path).blobs) == ["x"]
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]


def test_missing_directory(tmp_path):
    with pytest.raises(OutputPathError):
        _write(tmp_path / "nope" / "m.entity", {})


def test_never_writes_over_the_input(small):
    path, _ = small
    with pytest.raises(OutputPathError, match="input"):
        with atomic_output(path, force=True, inputs=[path]):
            pass
    link = path.with_name("hard.entity")
    os.link(path, link)
    with pytest.raises(OutputPathError):
        EntityWriter(link, force=True, inputs=[path])


def test_read_only_directory(tmp_path):
    base = tmp_path if os.geteuid() != 0 else Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(base, 0o755)  # traversable by the unprivileged user below
    ro = base / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    if os.geteuid() != 0:
        with pytest.raises(OutputPathError):
            _write(ro / "m.entity", {})
        return
    # root ignores permission bits: import as root, then drop to an unprivileged uid.
    code = textwrap.dedent(f"""
        import os
        from entity.dotentity.container import EntityWriter
        from poly.errors import OutputPathError
        os.setgid(65534)
        os.setuid(65534)
        try:
            EntityWriter({str(ro / "m.entity")!r})
        except OutputPathError:
            raise SystemExit(0)
        raise SystemExit(3)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert res.returncode == 0, res.stderr.decode()
    assert list(ro.iterdir()) == []
    os.chmod(ro, 0o755)
    shutil.rmtree(base)


def test_exception_and_interrupt_remove_the_temp_file(tmp_path):
    out = tmp_path / "x.bin"
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with atomic_output(out) as f:
                f.write(b"partial")
                raise exc
        assert list(tmp_path.iterdir()) == []


def test_disk_full_is_typed_and_leaves_nothing(tmp_path):
    # RLIMIT_FSIZE makes writes beyond 1 MiB fail with EFBIG (Python ignores SIGXFSZ).
    code = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        import numpy as np
        from entity.dotentity.container import EntityWriter
        from poly.errors import InsufficientSpaceError
        try:
            w = EntityWriter({str(tmp_path / "big.entity")!r})
            w.add("x", np.zeros(1 << 19, np.float32))
        except InsufficientSpaceError:
            raise SystemExit(0)
        raise SystemExit(3)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert res.returncode == 0, res.stderr.decode()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InsufficientSpaceError):
        with atomic_output(tmp_path / "y.bin", expected_size=1 << 60):
            pass


def test_sweeps_stale_temps_of_dead_processes(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(proc.stdout)
    stale = tmp_path / f".m.entity.tmp-{dead_pid}-abcd"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 60, time.time() - 60))  # old enough, and locked by no one
    live = temp_name(tmp_path / "m.entity")  # ours: a live writer holds its flock
    fd = open_locked_temp(live)
    os.utime(live, (time.time() - 60, time.time() - 60))
    other = tmp_path / ".unrelated"
    other.write_bytes(b"z")
    try:
        assert sweep_stale_temps(tmp_path) == [stale]
        assert live.exists() and other.exists()
    finally:
        os.close(fd)


def _refusing_create(monkeypatch, directory: Path, err: int) -> None:
    real_open = os.open

    def fake_open(path, flags, *a, **k):
        if str(path).startswith(str(directory)) and flags & os.O_CREAT:
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)


def test_check_output_probes_a_directory_that_refuses_new_files(tmp_path, monkeypatch):
    _refusing_create(monkeypatch, tmp_path, errno.EROFS)
    with pytest.raises(OutputPathError, match="Read-only file system"):
        check_output(tmp_path / "m.entity")


def test_check_output_leaves_a_full_disk_to_the_write(tmp_path, monkeypatch):
    _refusing_create(monkeypatch, tmp_path, errno.ENOSPC)
    check_output(tmp_path / "m.entity")  # the real write reports the space (typed) itself


def test_check_output_probe_leaves_nothing_behind(tmp_path):
    check_output(tmp_path / "m.entity")
    assert list(tmp_path.iterdir()) == []

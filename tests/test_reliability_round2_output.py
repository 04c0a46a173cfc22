"""Reliability round 2 (issue #18), writing outputs (items 1, 4, 11: sweep): one test (or more) per item, reproducing the
reported input. Memory bounds are the peak RSS of a child process (`tests.round2_support`),
generous for a loaded machine; no test asserts a tight wall-clock time.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entity.convert import convert
from poly.errors import OutputPathError
from tests.fuzz.corpus import expect_error
from tests.hf_fixtures import make_tiny_checkpoint
from tests.round2_support import lucy, one_error_line

pytestmark = pytest.mark.timeout(300)


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


# --- item 4: temp files of a SIGKILLed convert do not fill the disk for good --------------------


def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size // 1024 + 1}k"
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True
    )
    return res.returncode == 0


def _killed_during_finish(src: Path, out: Path) -> None:
    """Fork a convert that SIGKILLs itself after copying the payload into the output temp file:
    the worst moment (payload and a complete output temp both on disk)."""
    pid = os.fork()
    if pid == 0:
        import signal

        from entity.dotentity import container as entity_format

        real = entity_format._copy_all

        def copy_then_die(*a, **k):
            real(*a, **k)
            os.kill(os.getpid(), signal.SIGKILL)

        entity_format._copy_all = copy_then_die
        try:
            convert(src, out, quant="f32")
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> Path:
    """~34 MB of f32 weights: larger than the 16 MB space margin, so a leftover matters."""
    cfg = {"hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 2}
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("r2big") / "m", "llama", config_overrides=cfg
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_item4_sigkilled_convert_leftovers_are_swept_before_writing(big_src, tmp_path):
    from entity.atomic import STALE_MIN_AGE_S, TEMP_PATTERN

    ref = tmp_path / "ref.entity"
    convert(big_src, ref, quant="f32")
    size = ref.stat().st_size
    assert size > 20 << 20
    mnt = tmp_path / "small"
    # A clean run needs payload + output + 16 MB margin; leftovers of a killed run (2 x size)
    # plus the retry's payload do not fit.
    if not _mount_tmpfs(mnt, 2 * size + (16 << 20) + (2 << 20)):
        pytest.skip("cannot mount a tmpfs here")
    try:
        _killed_during_finish(big_src, mnt / "m.entity")
        left = [p for p in mnt.iterdir() if TEMP_PATTERN.match(p.name)]
        assert len(left) == 2 and sum(p.stat().st_size for p in left) >= 2 * size - (1 << 20)
        time.sleep(STALE_MIN_AGE_S)  # leftovers are swept once old enough and unlocked
        code, _, err, rss = lucy("convert", big_src, "-o", mnt / "m.entity", "--quant", "f32")
        assert code == 0, err  # was "No space left on device" on every retry
        assert sorted(p.name for p in mnt.iterdir()) == ["m.entity"]
        assert (mnt / "m.entity").read_bytes() == ref.read_bytes()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# --- item 11a: the sweep never deletes a live writer's temp file ---------------------------------

_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(120)
"""


def test_item11_sweep_spares_a_locked_temp_of_a_dead_looking_pid(tmp_path):
    """A writer in another PID namespace or on another NFS host: its pid means nothing here,
    its flock does. Unlocked files are swept only when old enough."""
    from entity.atomic import STALE_MIN_AGE_S, sweep_stale_temps

    old = time.time() - 3600
    foreign = tmp_path / ".m.entity.tmp-999999-abcd"  # pid 999999: not alive in this namespace
    foreign.write_bytes(b"live writer elsewhere")
    os.utime(foreign, (old, old))
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(foreign)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        young = tmp_path / ".n.entity.tmp-999998-abcd"
        young.write_bytes(b"a writer that has not taken its lock yet")
        dead = tmp_path / ".o.entity.tmp-999997-abcd"
        dead.write_bytes(b"killed")
        os.utime(dead, (old, old))
        assert sweep_stale_temps(tmp_path) == [dead]
        assert foreign.exists() and young.exists()
        os.utime(young, (time.time() - 2 * STALE_MIN_AGE_S,) * 2)
        assert sweep_stale_temps(tmp_path) == [young]
        assert foreign.exists()
    finally:
        holder.kill()
        holder.wait()
    assert sweep_stale_temps(tmp_path) == [foreign]  # its writer died: the lock went with it

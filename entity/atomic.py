"""Atomic file output: temp file in the target directory, fsync, rename, fsync the directory.

An interrupted or failed write (exception, Ctrl-C, SIGKILL) never leaves a partial file at the
output path: the output is either absent, the old file, or the complete new file. Temp files are
named ``.<name>.tmp-<pid>-<hex>`` so a later run can sweep those left behind by dead processes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from poly.errors import InsufficientSpaceError, OutputExistsError, OutputPathError, PolyError

__all__ = [
    "atomic_output",
    "check_output",
    "temp_name",
    "sweep_stale_temps",
    "wrap_os_error",
    "open_locked_temp",
    "TEMP_PATTERN",
]

# `.<name>.tmp-<pid>-<hex>`: recognisable, hidden, and tied to the writing process.
TEMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-(?P<rand>[0-9a-f]+)$")
_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
_SPACE_MARGIN = 16 << 20  # preflight margin for filesystem metadata
# A temp file is stale when unlocked and this old (covers the instant between its creation and
# its flock), or, where the filesystem has no flock, when this old.
STALE_MIN_AGE_S = 1.0
STALE_UNLOCKABLE_S = 24 * 3600.0


def temp_name(path: str | os.PathLike) -> Path:
    """A fresh temp path next to ``path`` for this process."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")


def open_locked_temp(path: str | os.PathLike) -> int:
    """Create ``path`` (O_EXCL) and hold an exclusive flock on it for as long as the descriptor
    stays open: the mark of a live writer that `sweep_stale_temps` never removes, whatever PID
    namespace or host (NFS) the writer runs on."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # a filesystem without locks: the sweep then waits for STALE_UNLOCKABLE_S
    return fd


def _is_stale(path: str, now: float) -> bool:
    """Old enough and locked by no one (the lock is taken to test it, and dropped at once)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        age = now - st.st_mtime
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live writer holds it
        except OSError:  # no locking here (ENOLCK, EOPNOTSUPP): only the age can tell
            return age >= STALE_UNLOCKABLE_S
        return age >= STALE_MIN_AGE_S
    finally:
        os.close(fd)


def sweep_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Remove our temp files in ``directory`` that no live writer holds (see `open_locked_temp`)
    and that are old enough (`STALE_MIN_AGE_S`; `STALE_UNLOCKABLE_S` where flock is unsupported).
    """
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for entry in entries:
        if TEMP_PATTERN.match(entry.name) is None or not entry.is_file(follow_symlinks=False):
            continue
        if not _is_stale(entry.path, now):
            continue
        try:
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            pass
    return removed


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(
    path: str | os.PathLike, *, force: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> None:
    """Raise the typed error `atomic_output` would raise for ``path`` (to fail before slow work),
    including a directory that refuses new files (read-only filesystem, no permission)."""
    out = Path(os.path.abspath(os.fspath(path)))
    _check_target(out, force, list(inputs))
    _probe_writable(out)


def _probe_writable(out: Path) -> None:
    """Create and remove the temp file `atomic_output` would create; a full disk is left to the
    space checks of the real write (a probe of zero bytes proves nothing about room)."""
    tmp = temp_name(out)
    try:
        os.close(open_locked_temp(tmp))
    except OSError as exc:
        if exc.errno in _SPACE_ERRNOS:
            return
        raise wrap_os_error(exc, out) from exc
    _unlink_quiet(tmp)


def _check_target(out: Path, force: bool, inputs: Iterable[str | os.PathLike]) -> None:
    try:
        _check_target_unsafe(out, force, inputs)
    except OSError as exc:  # e.g. a parent directory we may not even look into
        raise OutputPathError(f"cannot use output path: {exc.strerror}", path=str(out)) from exc


def _check_target_unsafe(out: Path, force: bool, inputs: Iterable[str | os.PathLike]) -> None:
    parent = out.parent
    if not parent.is_dir():
        raise OutputPathError(f"output directory does not exist: {parent}", path=str(out))
    for src in inputs:
        if _same_file(out, Path(src)):
            raise OutputPathError(
                "output path is the input file (never written over)", path=str(out)
            )
    if out.is_dir():
        raise OutputPathError("output path is a directory", path=str(out))
    _refuse_special(out)
    if (out.exists() or out.is_symlink()) and not force:
        raise OutputExistsError("output exists (use force=True / --force)", path=str(out))


def _refuse_special(out: Path) -> None:
    """An existing output that is not a regular file (device, FIFO, socket, or a symlink to one)
    is never replaced, whatever ``force`` says: `os.replace` would turn /dev/null into a file."""
    try:
        st = os.stat(out)  # follows symlinks: a link to a device is refused too
    except FileNotFoundError:
        return  # absent, or a dangling symlink (replaced only with force)
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise OutputPathError(f"output path is a {kind} (never overwritten)", path=str(out))


_KINDS = {
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
}


def wrap_os_error(exc: OSError, out: Path) -> PolyError:
    """The typed error of a failed output write (no space, or a bad path)."""
    if exc.errno in _SPACE_ERRNOS:
        return InsufficientSpaceError(
            f"not enough space writing output: {exc.strerror}", path=str(out)
        )
    return OutputPathError(f"cannot write output: {exc.strerror or exc}", path=str(out))


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # some filesystems refuse opening directories; the rename itself is done
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _preflight_space(parent: Path, expected_size: int | None, out: Path) -> None:
    if not expected_size:
        return
    st = os.statvfs(parent)  # shutil.disk_usage's reading (shutil: not imported to read a file)
    free = st.f_bavail * st.f_frsize
    if free < expected_size + _SPACE_MARGIN:
        raise InsufficientSpaceError(
            f"need about {expected_size + _SPACE_MARGIN} bytes, {free} free", path=str(out)
        )


@contextmanager
def atomic_output(
    path: str | os.PathLike,
    *,
    force: bool = False,
    inputs: Iterable[str | os.PathLike] = (),
    expected_size: int | None = None,
) -> Iterator[BinaryIO]:
    """Open a temp file next to ``path``; on clean exit fsync it and rename it over ``path``.

    Refuses an existing output unless ``force`` (`OutputExistsError`) and any output that is one of
    ``inputs`` (`OutputPathError`, compared with ``os.path.samefile``). Missing or unwritable
    directories give `OutputPathError`; ENOSPC/EFBIG give `InsufficientSpaceError`. On any
    exception (including KeyboardInterrupt) the temp file is removed and nothing else changes.
    The yielded file object's ``name`` is the temp path.
    """
    out = Path(os.path.abspath(os.fspath(path)))
    inputs = list(inputs)
    _check_target(out, force, inputs)
    sweep_stale_temps(out.parent)
    _preflight_space(out.parent, expected_size, out)
    tmp = temp_name(out)
    try:
        fd = open_locked_temp(tmp)
    except OSError as exc:
        raise wrap_os_error(exc, out) from exc
    f = os.fdopen(fd, "w+b")
    try:
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            _check_target(out, force, inputs)  # the world may have changed while we wrote
            try:
                os.replace(tmp, out)  # still locked: no sweep can take it before the rename
            except OSError as exc:
                raise wrap_os_error(exc, out) from exc
        finally:
            f.close()
    except OSError as exc:
        _unlink_quiet(tmp)
        if exc.errno in _SPACE_ERRNOS:
            raise wrap_os_error(exc, out) from exc
        raise  # e.g. an unreadable source file: not an output problem
    except BaseException:
        _unlink_quiet(tmp)
        raise
    _fsync_dir(out.parent)


def _unlink_quiet(p: Path) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass

"""Where poly keeps what it learns between processes (`poly_home`), and how a cache file is
written (`write_renamed`): the layout, tokenizer and tuning caches share both."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["poly_home", "write_renamed"]


def poly_home() -> Path:
    """``$POLY_HOME`` or ``~/.cache/poly`` (read at each call: tests and lucy set it late)."""
    return Path(os.environ.get("POLY_HOME") or Path.home() / ".cache" / "poly")


def write_renamed(path: Path, fill, *, durable: bool = False) -> bool:
    """`fill(file)` into a temporary name beside `path`, renamed to `path`: a reader (a mapping)
    never sees a file change in place. ``durable``: the file and its folder are fsynced too, so
    a crash cannot leave an empty file under the name. False where it fails (a full disk, no
    permission, a read-only home): a cache then just stays in memory or unwritten."""
    import tempfile  # here, not at the top: an open that writes nothing never loads it

    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            fill(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        if durable:
            _fsync_dir(path.parent)
    except OSError:
        return False
    finally:
        if tmp is not None:  # a failure before the rename (a full disk): no stray temp file
            Path(tmp).unlink(missing_ok=True)
    return True


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse a directory fsync: the rename stands
    finally:
        os.close(fd)

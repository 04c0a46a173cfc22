"""Where poly keeps what it learns between processes (`poly_home`), and how a cache file is
written (`write_renamed`, or `write_renamed_later` on a worker thread): the layout, tokenizer
and tuning caches share them."""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import threading
from pathlib import Path

__all__ = ["flush", "holding", "pending", "poly_home", "write_renamed", "write_renamed_later"]


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


# the worker of write_renamed_later: its queue (None before the first call, and in a child),
# the files not yet written, whether a Ctrl-C gave up on them, the `holding` blocks running
_later: dict = {"queue": None, "pending": 0, "skip": False, "holds": 0}
_later_lock = threading.Lock()
_open_now = threading.Condition()  # the worker waits on it while `holding` blocks run


@contextlib.contextmanager
def holding():
    """Writes handed to `write_renamed_later` inside wait until every such block has ended: a
    model's open runs without a disk writer beside it (the written pages and the open's own
    compete for memory: docs/performance.md). `flush` inside such a block would never return."""
    with _open_now:
        _later["holds"] += 1
    try:
        yield
    finally:
        with _open_now:
            _later["holds"] = max(0, _later["holds"] - 1)  # a forked child's began in its parent
            _open_now.notify_all()


def write_renamed_later(path: Path, fill) -> None:
    """`write_renamed(path, fill)` on one worker thread, in the order given, while the caller
    goes on: an 8B model's layouts (8 GB, bound by the disk's write speed) are written after
    its open, not during it. `fill` keeps what it writes alive until then. The interpreter's
    exit waits for the writes (`flush`), so a one-shot process still leaves them written."""
    with _later_lock:
        if _later["queue"] is None:
            _later["queue"] = q = queue.SimpleQueue()
            threading.Thread(target=_work, args=(q,), name="poly-cache-writer", daemon=True).start()
            atexit.register(flush)
        _later["pending"] += 1
    _later["queue"].put((path, fill))


def pending() -> int:
    """Files handed to `write_renamed_later` and not yet written."""
    return _later["pending"]


def flush() -> None:
    """Wait for every write handed to `write_renamed_later` so far (Ctrl-C stops waiting)."""
    q = _later["queue"]
    if q is None or _later["skip"]:
        return
    done = threading.Event()
    q.put(done)
    try:
        done.wait()
    except KeyboardInterrupt:
        _later["skip"] = True  # nor at the exit: the next open makes the unwritten files


def _work(q: queue.SimpleQueue) -> None:
    while True:
        item = q.get()
        with _open_now:
            _open_now.wait_for(lambda: _later["holds"] == 0)
        if isinstance(item, threading.Event):
            item.set()
            continue
        try:
            write_renamed(*item)
        except Exception:  # noqa: BLE001 - a cache file that cannot be made stays unwritten
            pass
        with _later_lock:
            _later["pending"] -= 1
        del item  # what `fill` held (a model's copy) goes now, not at the next write


def _forget_worker() -> None:
    """A forked child has no worker thread, nor the opens other threads were running: its
    first write starts its own worker."""
    global _later_lock, _open_now
    _later_lock, _open_now = threading.Lock(), threading.Condition()
    _later.update(queue=None, pending=0, skip=False, holds=0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)

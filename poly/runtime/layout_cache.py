"""Repacked weight layouts kept on disk between processes (issue 62: open -> first logits).

The repacked copies (`poly.runtime.repack`: rows by 16 or 8, float rows k-major) are a pure
function of a matrix's stored bytes, yet made again by every process that opens the model. The
open that makes them writes them under ``$POLY_HOME/layouts/<source>/`` (default ~/.cache/poly)
as one pack (`layout_pack`, at the end of `packing`: entity.load) or, made outside an open, as
.npy files. <source> hashes the model file's identity (path, device, inode, size, mtime, its
first 64 KB) and the C extension's build (setup.py's hash of its sources, compiler and flags: a
build of other sources may lay rows out differently). A later open maps them copy-on-write: no
copy is made, the first forward pulls the pages from the page cache. It also maps the model
file's other kept pages from one `kept-*.bin` copy (`KeptPages`) instead of reading them, so a
rewrite of the model file cannot reach the model. A `.entity` file whose blob checksums all
matched leaves a `blobs-verified` marker there (`mark_verified`): a later open of the same file
skips them. Nothing is rewritten in place (a mapping of a file cut short would fault): files
are renamed in (`write_renamed`), a reader never sees half a file.

A .npy file is used only when its header is byte for byte the one poly writes for the expected
shape and dtype and its size matches, a pack's entry only for the dtype and shape asked for
(pickles are never read); else it is ignored and written again. A directory whose source file
is gone or changed is removed when a new one is written. POLY_LAYOUT_CACHE=0 turns it off;
matrices under 64 KB are not cached. Past POLY_LAYOUT_CACHE_MAX bytes in all (default 16 GiB)
the directories used longest ago are removed, a model file larger than that is not cached at
all (its copies are made in C at each open), and nothing is written where it would leave less
than 5% of the disk free (`_has_room`). A model file of LATER_BYTES or more has its layouts
written on the cache writer's thread after the open (`write_renamed_later`: 8 GB is tens of
seconds of disk); the process's exit waits for them.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import mmap
import os
import threading
from pathlib import Path

import numpy as np

from poly.digest import hasher, hexdigest
from poly.filesnapshot import FileSnapshot, map_private, snapshot_of
from poly.runtime import layout_pack
from poly.runtime.cache_files import poly_home, write_renamed, write_renamed_later

VERSION = 3  # 2: files named by layout (interleave16-/kquant_interleave8-<kind>, float_kmajor16);
# 3: Q8_0 and int8 records by 16 without code sums
MIN_BYTES = 64 << 10  # smaller layouts cost less to make than a file to open
_HEAD = 64 << 10  # bytes of the model file hashed into its key
DEFAULT_MAX_BYTES = 16 << 30
LATER_BYTES = 1 << 30  # model files this large get their layouts written after the open
FREE_SHARE = 0.05  # of the disk left free after a model's layouts are written


def max_bytes() -> int:
    """POLY_LAYOUT_CACHE_MAX (bytes, K/M/G suffixes) or the default; a bad value is the default
    here (lucy's start-up check names it)."""
    raw = os.environ.get("POLY_LAYOUT_CACHE_MAX", "").strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1:], 1)
    digits = raw[:-1] if scale > 1 else raw
    return int(digits) * scale if digits.isdigit() else DEFAULT_MAX_BYTES


def enabled() -> bool:
    return os.environ.get("POLY_LAYOUT_CACHE", "").strip() != "0"


def cache_root() -> Path:
    return poly_home() / "layouts"


def _ext_identity() -> str:
    """The C extension that makes the layouts: its build key (setup.py's hash of the sources,
    compiler and flags: one cache for every install of the same build), else its file, and what
    it lays out; not the thread count a process runs with."""
    from poly.runtime import ckernels

    try:
        info = {k: v for k, v in ckernels.EXT.info().items() if k != "threads"}
        if info.get("build"):
            return repr(sorted(info.items()))
        st = os.stat(ckernels.EXT.__file__)
    except (AttributeError, OSError, TypeError):
        return "none"
    return f"{ckernels.EXT.__file__}|{st.st_size}|{st.st_mtime_ns}|{sorted(info.items())}"


def source_dir(snap: FileSnapshot) -> Path | None:
    """The directory of `snap`'s file (computed once per snapshot), None when it cannot be
    identified (fstat fails)."""
    got = getattr(snap, "_layout_dir", False)
    if got is not False:
        return got
    try:
        st = os.fstat(snap.fd)
    except OSError:
        snap._layout_dir = None
        return None
    head = hasher(np.frombuffer(snap, np.uint8, count=min(_HEAD, snap.size)))
    ident = f"{VERSION}|{snap.path}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|"
    key = hasher((ident + head.hexdigest() + "|" + _ext_identity()).encode())
    snap._layout_dir = cache_root() / key.hexdigest()[:32]
    snap._layout_source = {"path": snap.path, "ino": st.st_ino, "size": st.st_size,
                           "mtime_ns": st.st_mtime_ns, "version": VERSION}  # fmt: skip
    return snap._layout_dir


def _entry(raw: np.ndarray, name: str, extra: bytes) -> tuple[FileSnapshot, Path, str] | None:
    """(snapshot, directory, key) of the layout `name` of `raw` (its .npy file is <key>.npy), or
    None where it is not cached: off, small, or `raw` is not a view of a file's `FileSnapshot`."""
    if raw.nbytes < MIN_BYTES:
        return None
    snap = snapshot_of(raw)
    if snap is None or snap.closed:
        return None
    folder = snap.__dict__.get("_layout_use", False)
    if folder is False:  # a file past the cap: its layouts would evict every other model's
        off = not enabled() or snap.size > max_bytes()
        folder = snap._layout_use = None if off else source_dir(snap)
    if folder is None:
        return None
    offset = snap.offset_of(raw)
    tag = hexdigest(extra)[:12] if extra else "0"
    return snap, folder, f"{offset}-{raw.nbytes}-{name}-{tag}"


def load(raw: np.ndarray, name: str, shape: tuple, dtype, extra: bytes = b"") -> np.ndarray | None:
    """The cached layout `name` of `raw` (of `shape` and `dtype`) mapped from its model's pack or
    its .npy file, or None (not cached, off, or a file that does not match: `store` writes it)."""
    got = _entry(raw, name, extra)
    if got is None:
        return None
    snap, folder, key = got
    shape, dtype = tuple(shape), np.dtype(dtype)
    pack = _pack_of(snap, folder)
    found = None if pack is None else pack.get(key, shape, dtype)
    if found is None and (found := _read(folder / f"{key}.npy", shape, dtype)) is not None:
        _pend(snap, key, found, served=True)  # an earlier open's file: moved into a new pack
    return found


def store(raw: np.ndarray, name: str, out: np.ndarray, extra: bytes = b"") -> None:
    """Write `out`, the layout `name` of `raw`: into its model's pack at the end of a `packing`
    block, else as a .npy file; errors (a full disk, no permission) leave it uncached."""
    got = _entry(raw, name, extra)
    if got is None:
        return
    snap, folder, key = got
    if not _pend(snap, key, out):
        write_file(snap, folder / f"{key}.npy", _npy(out), later=snap.size >= LATER_BYTES)


def _npy(out: np.ndarray):
    return lambda f: np.lib.format.write_array(f, np.ascontiguousarray(out), allow_pickle=False)


_PACKING = threading.local()


def _pend(snap: FileSnapshot, key: str, out: np.ndarray, served: bool = False) -> bool:
    """Keep `out` for the pack of the `packing` block running (False: none runs); `served`: it
    was mapped from its .npy file."""
    pending = getattr(_PACKING, "pending", None)
    if pending is None:
        return False
    arrays, files = pending.setdefault(id(snap), (snap, {}, []))[1:]
    arrays[key] = out
    if served:
        files.append(key)
    return True


@contextlib.contextmanager
def packing():
    """Layouts stored inside the block (a model's open) are written at its end as one pack per
    model file (`layout_pack`), which later opens map once; where that file already has a pack,
    as .npy files. A block left by an error writes nothing; nested blocks write at the outer's
    end."""
    if getattr(_PACKING, "pending", None) is not None:
        yield
        return
    _PACKING.pending = {}
    try:
        yield
        made, _PACKING.pending = _PACKING.pending, None
        for snap, arrays, served in made.values():
            _write_pack(snap, arrays, served)
    finally:
        _PACKING.pending = None


def _write_pack(snap: FileSnapshot, arrays: dict[str, np.ndarray], served: list[str]) -> None:
    """A pack of `arrays` where `snap`'s file has none: the .npy files of the `served` ones (an
    earlier version's cache) removed once it is written; else the made ones as .npy files (the
    layouts its pack lacks)."""
    folder, later = source_dir(snap), snap.size >= LATER_BYTES
    if folder is None:
        return
    if _pack_of(snap, folder) is None:
        fill = layout_pack.fill(arrays)

        def fill_and_remove(f) -> None:
            fill(f)
            for key in served:
                (folder / f"{key}.npy").unlink(missing_ok=True)

        write_file(snap, folder / layout_pack.NAME, fill_and_remove, later)
        return
    for key in set(arrays).difference(served):
        write_file(snap, folder / f"{key}.npy", _npy(arrays[key]), later)


def _pack_of(snap: FileSnapshot, folder: Path) -> layout_pack.Pack | None:
    """The pack of `snap`'s file, mapped at its first use in this process."""
    got = getattr(snap, "_layout_pack", False)
    if got is False:
        got = snap._layout_pack = layout_pack.read(folder / layout_pack.NAME)
    return got


def write_file(snap: FileSnapshot, path: Path, fill, later: bool = False) -> None:
    """`write_renamed` into `snap`'s directory, made (and the cache pruned) on its first file;
    ``later``: on the cache writer's thread (`write_renamed_later`). Errors (a full disk, no
    permission) leave it uncached, as does a disk short of room."""
    if not _has_room(snap):
        return
    try:
        fresh = not path.parent.is_dir()
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh:
            (path.parent / "source.json").write_text(json.dumps(snap._layout_source))
            _prune(path.parent, snap.size)
    except OSError:
        return
    (write_renamed_later if later else write_renamed)(path, fill)


def has_room(nbytes: int) -> bool:
    """Whether the cache's disk keeps FREE_SHARE of itself free after `nbytes` more (a model's
    layouts, about its file's size): an 8B model's copies never fill a disk."""
    folder = cache_root()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - nbytes >= FREE_SHARE * st.f_blocks * st.f_frsize


def _has_room(snap: FileSnapshot) -> bool:
    """`has_room` for `snap`'s model, asked once per file."""
    room = getattr(snap, "_layout_room", None)
    if room is None:
        room = snap._layout_room = has_room(snap.size)
    return room


def _verified_path(snap: FileSnapshot) -> Path | None:
    folder = source_dir(snap) if enabled() else None
    return None if folder is None else folder / "blobs-verified"


def verified(snap: FileSnapshot) -> bool:
    """Whether an earlier open checked every blob checksum of this same file (`mark_verified`):
    its identity is the directory's (path, inode, size, mtime, first 64 KB)."""
    path = _verified_path(snap)
    return path is not None and path.is_file()


def mark_verified(snap: FileSnapshot) -> None:
    """Record that every blob checksum of `snap`'s file matched (an empty marker file)."""
    path = _verified_path(snap)
    if path is not None:
        write_file(snap, path, lambda f: None)


def _read(path: Path, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
    """The layout at `path` mapped copy-on-write (no copy made at open: the first forward pulls
    its pages from the page cache, as llama.cpp's mapping does), or None where it does not match.
    The .npy header must be byte for byte the one `store` writes for `shape` and `dtype`: numpy's
    own parser compiles each header with `ast`, a cost every layout of an open would pay."""
    head = _npy_header(shape, dtype)
    n = math.prod(shape)
    size = len(head) + n * dtype.itemsize
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size or dtype.hasobject:
            return None
        if os.pread(fd, len(head), 0) != head:
            return None
        mapped = map_private(fd, size)
        if mapped is None:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        return np.frombuffer(mapped, dtype, count=n, offset=len(head)).reshape(shape)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)  # the mapping holds the file


@functools.lru_cache(maxsize=256)  # a model's layers share their shapes
def _npy_header(shape: tuple, dtype: np.dtype) -> bytes:
    """The magic and header `np.lib.format.write_array` writes for a C-ordered `shape`/`dtype`."""
    buf = io.BytesIO()
    fmt = np.lib.format
    meta = {"descr": fmt.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)}
    fmt.write_array_header_1_0(buf, meta)
    return buf.getvalue()


def _prune(keep: Path, coming: int = 0) -> None:
    """Remove the other layout directories whose source file is gone or changed, or whose
    layouts are of an older VERSION (never read again; another build's of this VERSION stays,
    as two installs may share the cache; a source.json from before the field is kept), and
    temporary files a killed writer left (an hour old); then the oldest directories past the
    cap with `coming` bytes (the model file's size) still to be written into `keep`."""
    for d in keep.parent.iterdir():
        if d == keep or not d.is_dir():
            continue
        _remove_stale_temps(d)
        try:
            src = json.loads((d / "source.json").read_text())
        except (OSError, ValueError):
            continue  # being written by another process, or not ours: left alone
        try:
            st = os.stat(src["path"])
            current = (st.st_ino, st.st_size, st.st_mtime_ns) == (
                src["ino"], src["size"], src["mtime_ns"]
            ) and src.get("version", VERSION) >= VERSION  # fmt: skip
        except (OSError, KeyError, TypeError, AttributeError):
            current = False
        if not current:
            _remove_tree(d)
    _cap(keep, coming)


def _remove_stale_temps(d: Path, age: float = 3600.0) -> None:
    """`write_renamed`'s temporary files in `d` untouched for `age` seconds: a writer that was
    killed (a live one writes to its file all along)."""
    import time

    for f in d.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - f.stat().st_mtime > age:
                f.unlink()


def _size(d: Path) -> int:
    try:
        return sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    except OSError:
        return 0


def _cap(keep: Path, coming: int = 0) -> None:
    """Remove the directories modified longest ago until the rest and `coming` bytes fit in
    max_bytes()."""
    dirs = []
    for d in keep.parent.iterdir():
        if d != keep and d.is_dir() and (d / "source.json").is_file():
            try:
                dirs.append((d.stat().st_mtime, d))
            except OSError:
                continue
    total = _size(keep) + coming + sum(_size(d) for _, d in dirs)
    for _, d in sorted(dirs):
        if total <= max_bytes():
            break
        total -= _size(d)
        _remove_tree(d)


def _remove_tree(d: Path) -> None:
    import shutil  # here, not at the top: it loads the compression modules (open time)

    shutil.rmtree(d, ignore_errors=True)

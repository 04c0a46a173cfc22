"""A model's repacked layouts in one file (`layout_cache`): written by the open that made them,
mapped once by each later open. As .npy files, every matrix cost an open, a stat, a header read
and a mapping of its own (211 for SmolLM2); the pack costs one of each, then a view per matrix.

The file: MAGIC, the index's length (8 bytes, little-endian), the index (JSON: {"v": VERSION,
"entries": {key: [offset, dtype, shape]}}), then each layout's bytes at a page-aligned offset.
A pack is used only where its magic, version and index parse and every entry lies inside the
file, and an entry only for the dtype and shape asked for; else it is ignored (never unpickled,
no dtype built from the file). It is never rewritten in place: `write_renamed` renames it in.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path

import numpy as np

from poly.filesnapshot import map_private

MAGIC = b"POLYPACK"
VERSION = 1
NAME = "layouts.pack"
_ALIGN = mmap.PAGESIZE


class Pack:
    """A mapped pack: `get` gives a layout as a copy-on-write view of the mapping."""

    def __init__(self, mapped, entries: dict[str, tuple[int, str, tuple[int, ...]]]):
        self._mapped = mapped
        self.entries = entries

    def get(self, key: str, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        entry = self.entries.get(key)
        if entry is None or entry[1] != dtype.str or entry[2] != shape:
            return None
        n = math.prod(shape)
        return np.frombuffer(self._mapped, dtype, count=n, offset=entry[0]).reshape(shape)


def read(path: Path) -> Pack | None:
    """The pack at `path` mapped copy-on-write, or None (absent, or not a pack this writes)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, len(MAGIC) + 8, 0)
        if len(head) != len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            return None
        n = int.from_bytes(head[len(MAGIC) :], "little")
        if n > size:
            return None
        entries = _entries(os.pread(fd, n, len(head)), size)
        if entries is None:
            return None
        mapped = map_private(fd, size)
        if mapped is None:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        return Pack(mapped, entries)
    except (OSError, ValueError, RecursionError):  # RecursionError: an index nested too deep
        return None
    finally:
        os.close(fd)  # the mapping holds the file


def _entries(raw: bytes, size: int) -> dict | None:
    """The index's entries, checked: each a (page-aligned offset, dtype string, shape) inside a
    file of `size` bytes; None where any is not."""
    index = json.loads(raw)
    if not isinstance(index, dict) or index.get("v") != VERSION:
        return None
    found = index.get("entries")
    if not isinstance(found, dict):
        return None
    out = {}
    for key, entry in found.items():
        if not (isinstance(entry, list) and len(entry) == 3):
            return None
        at, descr, shape = entry
        ok = isinstance(at, int) and isinstance(descr, str) and isinstance(shape, list)
        if not ok or at % _ALIGN or not all(isinstance(d, int) and d >= 0 for d in shape):
            return None
        width = _ITEMSIZE.get(descr)
        if width is None or at < 0 or at + math.prod(shape) * width > size:
            return None
        out[key] = (at, descr, tuple(shape))
    return out


# the dtypes a layout may be stored in: plain numbers (repack: records as bytes, float rows as
# their bits), never objects nor records
_ITEMSIZE = {np.dtype(t).str: np.dtype(t).itemsize for t in "u1 i1 <u2 <i2 <f2 <u4 <i4 <f4".split()}


def fill(arrays: dict[str, np.ndarray]):
    """`write_renamed`'s fill for a pack of `arrays` (key -> C-contiguous layout)."""
    index, at = {}, 0
    for key, arr in arrays.items():
        index[key] = [at, arr.dtype.str, list(arr.shape)]
        at += -(-arr.nbytes // _ALIGN) * _ALIGN
    start = 0
    while True:  # the data starts past the index, whose length depends on where the data starts
        entries = {k: [start + e[0], e[1], e[2]] for k, e in index.items()}
        raw = json.dumps({"v": VERSION, "entries": entries}, separators=(",", ":")).encode()
        need = -(-(len(MAGIC) + 8 + len(raw)) // _ALIGN) * _ALIGN
        if need <= start:
            break
        start = need

    def write(f) -> None:
        f.write(MAGIC + len(raw).to_bytes(8, "little") + raw)
        for key, arr in arrays.items():
            f.seek(entries[key][0])
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
        f.truncate(start + at)

    return write

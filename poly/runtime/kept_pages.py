"""The pages of a model file that no repacked copy replaces, kept beside its layouts
(`poly.runtime.layout_cache`'s directory for the file): a later open maps them copy-on-write
instead of reading the model file into anonymous memory (issue 62: open time)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from poly.digest import hexdigest
from poly.filesnapshot import FileSnapshot
from poly.runtime.layout_cache import enabled, max_bytes, source_dir, write_file


class KeptPages:
    """The pages of a model file that no repacked copy replaces (`FileSnapshot.settle`'s kept
    ranges: matrices read as stored, norms, pinned tables), kept as one file per set of ranges,
    each range at a page boundary. A later open maps them from it copy-on-write instead of
    reading the model file into anonymous memory (issue 62: open time)."""

    @staticmethod
    def _path(snap: FileSnapshot, keep: list[tuple[int, int]]) -> Path | None:
        if not enabled() or snap.size > max_bytes() or not keep:
            return None
        folder = source_dir(snap)
        tag = hexdigest(repr(keep).encode())[:16]
        return None if folder is None else folder / f"kept-{tag}.bin"

    def map(self, snap: FileSnapshot, keep: list[tuple[int, int]]) -> bool:
        path = self._path(snap, keep)
        if path is None:
            return False
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            offsets = _page_offsets(keep)
            if os.fstat(fd).st_size != offsets[-1]:
                return False
            return all(snap.map_copy(lo, hi, fd, at) for (lo, hi), at in zip(keep, offsets))
        finally:
            os.close(fd)  # the mappings hold the file

    def store(self, snap: FileSnapshot, keep: list[tuple[int, int]]) -> None:
        path = self._path(snap, keep)
        if path is None:
            return
        offsets = _page_offsets(keep)

        def fill(f) -> None:
            with memoryview(snap) as mv:
                for (lo, hi), at in zip(keep, offsets):
                    f.seek(at)
                    f.write(mv[lo:hi])
                f.truncate(offsets[-1])

        write_file(snap, path, fill)


def _page_offsets(keep: list[tuple[int, int]]) -> list[int]:
    """Where each range starts in a kept-pages file, and (last) the file's size."""
    out = [0]
    for lo, hi in keep:
        out.append(out[-1] + -(-(hi - lo) // mmap.PAGESIZE) * mmap.PAGESIZE)
    return out


KEPT = KeptPages()

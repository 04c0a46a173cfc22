"""A model file's bytes in this process's memory (`FileSnapshot`), read in lazily while a model
opens (`deferred_reads`): weights are numpy views of it, and a rewritten file never reaches the
running model."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from poly.errors import ModelFileChangedError


class FileSnapshot(mmap.mmap):
    """A model file's bytes read into this process's own memory (private anonymous pages), so a
    change on disk (``cp other.gguf served.gguf`` truncates then rewrites the same inode) can
    never reach the running model: a file mapping's pages past a new end of file raise SIGBUS.

    Weights are numpy views on it, as on a file mapping. `release` (the repackers' "these rows
    are copied, drop them") maps the file's pages back over a range: read again, the rows come
    from the page cache, as before, and RSS holds one copy. ``lazy`` ranges (experts paged
    from disk) are mapped from the file from the start; `check` (fstat) tells whether the file
    still is the one loaded before such pages are read."""

    def __new__(cls, path, lazy: tuple[tuple[int, int], ...] = ()):
        fd = os.open(path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self = super().__new__(cls, -1, max(st.st_size, 1), flags=_PRIVATE)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.path, self.size = fd, str(path), st.st_size
        with memoryview(self) as mv:  # where the bytes lie: fixed while the mapping lives
            self.address = np.frombuffer(mv, np.uint8).ctypes.data
        self.identity = (st.st_size, st.st_mtime_ns)
        self._closer = weakref.finalize(self, os.close, fd)
        holes = sorted(r for r in (self._page_range(o, n) for o, n in lazy) if r[1] > r[0])
        holes = [h for h in holes if self._map_file(*h)]  # a range not mapped is read
        self.lazy, self.released, self.deferred = holes, [], False
        pending = getattr(_DEFER, "snapshots", None)
        whole = self._page_range(0, self.size)
        if pending is not None and self._map_file(*whole):  # read what is left at `settle`
            self.deferred = True
            pending.append(self)
            holes = [whole]
        from poly import timing

        with timing.phase("read"):
            self._read_between(holes)
        return self

    def _page_range(self, offset: int, length: int) -> tuple[int, int]:
        return -(-offset // PAGE) * PAGE, min((offset + length) // PAGE * PAGE, self.size)

    def _read_between(self, holes: list[tuple[int, int]]) -> None:
        pos = 0
        with memoryview(self) as mv:
            for lo, hi in [*holes, (self.size, self.size)]:
                if pos < lo:
                    self._pread(mv[pos:lo], pos)
                pos = max(pos, hi, lo)

    def _pread(self, dst: memoryview, at: int) -> None:
        """Fill `dst` with the file's bytes from `at` on, _PIECE at a time."""
        pos = 0
        while pos < dst.nbytes:
            got = os.preadv(self.fd, [dst[pos : pos + _PIECE]], at + pos)
            if got <= 0:
                raise ModelFileChangedError("the file shrank as it was read", path=self.path)
            pos += got

    def _map_file(self, start: int, stop: int) -> bool:
        """The file's pages [start, stop) over ours (MAP_FIXED): ours are freed."""
        return self._map_fixed(start, stop, mmap.PROT_READ, _FILE_FIXED, self.fd, start)

    def _map_fixed(self, start: int, stop: int, prot: int, flags: int, fd: int, at: int) -> bool:
        """mmap(2) over our pages [start, stop) (flags hold MAP_FIXED); False where it fails or
        this platform has no such call."""
        if _LIBC_MMAP is None or stop <= start:
            return False
        base = self.address
        return _LIBC_MMAP(base + start, stop - start, prot, flags, fd, at) == base + start

    def release(self, offset: int, length: int) -> None:
        """Hand the whole pages of [offset, offset + length) back to the file (see the class),
        but for pinned ones."""
        start, stop = self._page_range(offset, length)
        for lo, hi in sorted(getattr(self, "pinned", ())):
            if lo < stop and hi > start:
                self._give_back(start, lo)
                start = max(start, hi)
        self._give_back(start, stop)

    def _give_back(self, start: int, stop: int) -> None:
        if stop > start and (self._drop(start, stop) or self._map_file(start, stop)):
            self.released.append((start, stop))

    def _drop(self, start: int, stop: int) -> bool:
        """During a deferred open the file is mapped here already: the pages a read brought in
        are dropped (madvise) rather than the file mapped again (each such mmap split the
        mapping into more VMAs)."""
        if not self.deferred:
            return False
        try:
            self.madvise(mmap.MADV_DONTNEED, start, stop - start)
        except (AttributeError, OSError, ValueError):
            return False
        return True

    def evict(self, offset: int, length: int) -> None:
        """Drop the pages of [offset, offset + length) from the resident set while they are
        still mapped from the file (read once to check them, before `settle`)."""
        if self.deferred:
            start, stop = self._page_range(offset, length)
            self._drop(start, stop) or self._map_file(start, stop)

    def settle(self, copies: Any = None) -> None:
        """End a deferred open (`deferred_reads`): every page not released (nor lazy) is read
        into our own memory now, pinned ones always; the file must still be the one opened.
        `copies` (poly.runtime.kept_pages.KEPT) maps those pages from a private copy of them
        a former open wrote, instead of reading the file, and writes one when there is none."""
        if not self.deferred:
            return
        self.deferred = False
        gone = _merge([*self.released, *self.lazy])
        end = self._page_range(0, self.size)[1]
        keep = _merge([*_gaps(gone, end), *getattr(self, "pinned", ())])
        keep = [(lo, min(hi, end)) for lo, hi in keep if min(hi, end) > lo]
        from poly import timing

        with timing.phase("read"):
            # (a partial last page is never mapped: __new__ read it)
            if copies is None or not copies.map(self, keep):
                self._own_and_read(keep)
                if copies is not None:
                    copies.store(self, keep)
        self.check()

    def _own_and_read(self, keep: list[tuple[int, int]]) -> None:
        for lo, hi in keep:
            if not self._own(lo, hi):
                raise ModelFileChangedError(
                    "cannot map memory to read the file into", path=self.path
                )
        self._read_between(_gaps(keep, self.size))

    def map_copy(self, start: int, stop: int, fd: int, offset: int) -> bool:
        """Pages [start, stop) mapped copy-on-write from `fd` at `offset`: a copy of these bytes
        that no one rewrites in place (the layout cache's, renamed into place)."""
        return self._map_fixed(start, stop, _READ_WRITE, _COPY_FIXED, fd, offset)

    def _own(self, start: int, stop: int) -> bool:
        """Anonymous pages of our own over [start, stop) (MAP_FIXED), to be read into."""
        return self._map_fixed(start, stop, _READ_WRITE, _ANON_FIXED, -1, 0)

    def pin(self, offset: int, length: int) -> None:
        """Keep [offset, offset + length) in our memory: read every step (an embedding table's
        rows on lookup) while a repacked copy serves the rest, it must never come from the file."""
        page = (offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE)
        self.pinned = [*getattr(self, "pinned", ()), page]

    def unpin(self, offset: int, length: int) -> None:
        """Forget the pins inside [offset, offset + length) (a copy serves their lookups now)."""
        lo, hi = offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE
        self.pinned = [p for p in getattr(self, "pinned", ()) if not (lo <= p[0] and p[1] <= hi)]

    def offset_of(self, arr: np.ndarray) -> int:
        """Where `arr` (a view of these bytes) starts in the file."""
        return arr.ctypes.data - self.address

    def read_into(self, view: np.ndarray, out: np.ndarray) -> None:
        """`out[...] = view` read with pread from the file (the kernel copies from the page
        cache; a copy off the mapping takes a page fault per 4 KB), then `view`'s pages
        released. Both C-contiguous, of one size; during a
        deferred open (`deferred_reads`: the file is still the one opened, `settle` checks)."""
        at = self.offset_of(view)
        self._pread(memoryview(out.reshape(-1).view(np.uint8)), at)
        self.release(at, view.nbytes)

    def changed(self) -> bool:
        try:
            st = os.fstat(self.fd)
        except OSError:
            return True
        return (st.st_size, st.st_mtime_ns) != self.identity

    def check(self) -> None:
        """ModelFileChangedError when the file is no longer the one loaded (size or mtime)."""
        if self.changed():
            raise ModelFileChangedError(
                "the model file changed on disk since it was loaded; restart to load it again",
                path=self.path,
            )

    def array(self) -> np.ndarray:
        """The whole file as a read-only uint8 array (views of it keep the snapshot alive)."""
        arr = np.frombuffer(self, np.uint8, count=self.size)
        arr.flags.writeable = False
        return arr


def keep_in_memory(value: Any) -> None:
    """Pin the arrays of `value` (an ndarray or a quantized matrix's parts) where they view a
    `FileSnapshot`: a later release of their rows keeps them in our memory."""
    parts = [value] if isinstance(value, np.ndarray) else []
    parts += [getattr(value, n, None) for n in ("array", "raw", "scales", "packed")]
    enc = getattr(value, "encoded", None)
    parts += [getattr(enc, n, None) for n in ("codes", "scales")]
    for a in parts:
        if not isinstance(a, np.ndarray) or not a.nbytes:
            continue
        snap = snapshot_of(a)
        if snap is not None:
            snap.pin(snap.offset_of(a), a.nbytes)


def snapshot_of(arr: np.ndarray) -> FileSnapshot | None:
    """The `FileSnapshot` `arr` views (through numpy bases and memoryviews), or None."""
    b, seen = arr, 0
    while b is not None and not isinstance(b, FileSnapshot) and seen < 64:
        b, seen = (b.obj if isinstance(b, memoryview) else getattr(b, "base", None)), seen + 1
    return b if isinstance(b, FileSnapshot) else None


def _libc_calls() -> tuple:
    """libc's (mmap, munmap), or (None, None) where there is no such libc."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_, munmap = libc.mmap, libc.munmap
    except (OSError, AttributeError):
        return None, None
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int64]  # fmt: skip
    munmap.restype, munmap.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t]
    return mmap_, munmap


# None: releases keep our pages, layouts are mapped by mmap.mmap
_LIBC_MMAP, _LIBC_MUNMAP = _libc_calls() if hasattr(mmap, "MAP_PRIVATE") else (None, None)
_MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = mmap.PAGESIZE
_PIECE = 64 << 20
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_FILE_FIXED = getattr(mmap, "MAP_SHARED", 1) | 0x10  # MAP_FIXED (Linux, the BSDs, macOS)
_ANON_FIXED = _PRIVATE | 0x10
_COPY_FIXED = getattr(mmap, "MAP_PRIVATE", 2) | 0x10  # a file's pages, writes kept to ourselves
_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_DEFER = threading.local()  # .snapshots: the FileSnapshots opened inside `deferred_reads`


class _Mapped:
    """The owner of a mapping made by `map_private`: arrays on it keep it alive."""

    __slots__ = ("__array_interface__", "__weakref__")

    def __init__(self, at: int, size: int):
        self.__array_interface__ = {"data": (at, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}  # fmt: skip
        weakref.finalize(self, _LIBC_MUNMAP, at, size)


def map_private(fd: int, size: int) -> np.ndarray | None:
    """The first `size` bytes of file `fd` mapped copy-on-write, as a uint8 array that holds no
    descriptor (mmap.mmap keeps a dup of one per mapping: past 256 open descriptors the kernel
    grows the table behind an RCU grace period: docs/performance.md); unmapped once no array
    views it. None where libc's mmap is out of reach (then mmap.mmap serves)."""
    if _LIBC_MUNMAP is None or size <= 0:
        return None
    at = _LIBC_MMAP(None, size, _READ_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if at is None or at == _MAP_FAILED:
        return None
    return np.asarray(_Mapped(at, size))


@contextlib.contextmanager
def deferred_reads(copies: Any = None) -> Iterator[None]:
    """FileSnapshots opened inside map their file and read nothing until the block ends: then
    only the pages no repacked copy replaced (`release`) are read in (`FileSnapshot.settle`).
    A model opened this way never holds a weight twice, nor reads the bytes a copy serves
    (issue 62: open time and peak RSS); a block left by an error settles nothing. `copies`: see
    `FileSnapshot.settle`."""
    if getattr(_DEFER, "snapshots", None) is not None:  # nested: the outer block settles
        yield
        return
    _DEFER.snapshots = []
    try:
        yield
        for snap in _DEFER.snapshots:
            snap.settle(copies)
    finally:
        _DEFER.snapshots = None


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _gaps(ranges: list[tuple[int, int]], end: int) -> list[tuple[int, int]]:
    """The parts of [0, end) outside the sorted, disjoint `ranges`."""
    out, pos = [], 0
    for lo, hi in ranges:
        if lo > pos:
            out.append((pos, min(lo, end)))
        pos = max(pos, hi)
    return [r for r in [*out, (pos, end)] if r[1] > r[0]]

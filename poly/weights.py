"""Flat float32 weight storage plus cached stored representations per scheme."""

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

from poly.errors import LayerConfigError, ModelFileChangedError

ALIGN = 64


HUGE = 2 << 20  # transparent huge page size on x86-64; arrays this large or larger use them


def _huge_zeros(nbytes: int) -> np.ndarray | None:
    """Zeroed anonymous memory starting on a 2 MB boundary with MADV_HUGEPAGE: decode streams
    every weight once per token, and with 4 KB pages the TLB misses cost ~9 % of a float32
    step (SmolLM2: 19.8 vs 18.0 ms). None where mmap/madvise are not available."""
    try:
        mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = np.frombuffer(mm, dtype=np.uint8)  # the array keeps the mapping alive
        start = (-raw.ctypes.data) % HUGE  # the untouched slack before it never becomes resident
        # whole huge pages only: a tail on one would be resident in full (SmolLM2's 3.5 MB FFN
        # rows in 4 MB: 57 MB of an f32 model's RSS)
        mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE * HUGE)
    except (AttributeError, OSError, ValueError):
        return None
    return raw[start : start + nbytes]


def aligned_zeros(n: int, dtype=np.float32, align: int = ALIGN) -> np.ndarray:
    """Zeroed 1-D array whose data pointer is a multiple of `align` bytes (2 MB, on huge
    pages where the OS offers them, for arrays of 2 MB and more)."""
    itemsize = np.dtype(dtype).itemsize
    nbytes = n * itemsize
    raw = _huge_zeros(nbytes) if nbytes >= HUGE and HUGE % align == 0 else None
    if raw is None:
        raw = np.zeros(nbytes + align, dtype=np.uint8)
        start = (-raw.ctypes.data) % align
        raw = raw[start : start + nbytes]
    return raw.view(dtype)


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
                while pos < lo:
                    got = os.preadv(self.fd, [mv[pos : min(lo, pos + _PIECE)]], pos)
                    if got <= 0:
                        raise ModelFileChangedError(
                            "the file shrank as it was read", path=self.path
                        )
                    pos += got
                pos = max(pos, hi)

    def _map_file(self, start: int, stop: int) -> bool:
        """The file's pages [start, stop) over ours (MAP_FIXED): ours are freed."""
        if _LIBC_MMAP is None or stop <= start:
            return False
        with memoryview(self) as mv:
            base = np.frombuffer(mv, np.uint8).ctypes.data
        got = _LIBC_MMAP(base + start, stop - start, mmap.PROT_READ, _FILE_FIXED, self.fd, start)
        return got == base + start

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
        if stop > start and self._map_file(start, stop):
            self.released.append((start, stop))

    def evict(self, offset: int, length: int) -> None:
        """Drop the pages of [offset, offset + length) from the resident set while they are
        still mapped from the file (read once to check them, before `settle`)."""
        if self.deferred:
            self._map_file(*self._page_range(offset, length))

    def settle(self) -> None:
        """End a deferred open (`deferred_reads`): every page not released (nor lazy) is read
        into our own memory now, pinned ones always; the file must still be the one opened."""
        if not self.deferred:
            return
        self.deferred = False
        gone = _merge([*self.released, *self.lazy])
        keep = _merge([*_gaps(gone, self._page_range(0, self.size)[1]),
                       *getattr(self, "pinned", ())])  # fmt: skip
        for lo, hi in keep:
            hi = min(hi, self._page_range(0, self.size)[1])
            if hi > lo and not self._own(lo, hi):
                raise ModelFileChangedError(
                    "cannot map memory to read the file into", path=self.path
                )
        from poly import timing

        with timing.phase("read"):
            self._read_between(_gaps(keep, self.size))
        self.check()

    def _own(self, start: int, stop: int) -> bool:
        """Anonymous pages of our own over [start, stop) (MAP_FIXED), to be read into."""
        with memoryview(self) as mv:
            base = np.frombuffer(mv, np.uint8).ctypes.data
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        return _LIBC_MMAP(base + start, stop - start, prot, _ANON_FIXED, -1, 0) == base + start

    def pin(self, offset: int, length: int) -> None:
        """Keep [offset, offset + length) in our memory: read every step (an embedding table's
        rows on lookup) while a repacked copy serves the rest, it must never come from the file."""
        page = (offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE)
        self.pinned = [*getattr(self, "pinned", ()), page]

    def unpin(self, offset: int, length: int) -> None:
        """Forget the pins inside [offset, offset + length) (a copy serves their lookups now)."""
        lo, hi = offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE
        self.pinned = [p for p in getattr(self, "pinned", ()) if not (lo <= p[0] and p[1] <= hi)]

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
        b, seen = a, 0
        while b is not None and not isinstance(b, FileSnapshot) and seen < 64:
            b, seen = (b.obj if isinstance(b, memoryview) else getattr(b, "base", None)), seen + 1
        if isinstance(b, FileSnapshot):
            with memoryview(b) as mv:
                b.pin(a.ctypes.data - np.frombuffer(mv, np.uint8).ctypes.data, a.nbytes)


def _libc_mmap():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.mmap
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int64]  # fmt: skip
    return fn


_LIBC_MMAP = _libc_mmap() if hasattr(mmap, "MAP_PRIVATE") else None  # None: releases keep ours
PAGE = mmap.PAGESIZE
_PIECE = 64 << 20
_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_FILE_FIXED = getattr(mmap, "MAP_SHARED", 1) | 0x10  # MAP_FIXED (Linux, the BSDs, macOS)
_ANON_FIXED = _PRIVATE | 0x10
_DEFER = threading.local()  # .snapshots: the FileSnapshots opened inside `deferred_reads`


@contextlib.contextmanager
def deferred_reads() -> Iterator[None]:
    """FileSnapshots opened inside map their file and read nothing until the block ends: then
    only the pages no repacked copy replaced (`release`) are read in (`FileSnapshot.settle`).
    A model opened this way never holds a weight twice, nor reads the bytes a copy serves
    (issue 62: open time and peak RSS); a block left by an error settles nothing."""
    if getattr(_DEFER, "snapshots", None) is not None:  # nested: the outer block settles
        yield
        return
    _DEFER.snapshots = []
    try:
        yield
        for snap in _DEFER.snapshots:
            snap.settle()
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


class Generations:
    """A process-wide change counter: every WeightStore change and every layer/model edit that a
    cached plan depends on bumps it, so a plan built at generation g is valid while it is g."""

    value = 0

    @classmethod
    def bump(cls) -> int:
        cls.value += 1
        return cls.value


class PlanCache:
    """Plans by name, each valid for the generation it was built at (one compare per lookup)."""

    __slots__ = ("plans",)

    def __init__(self) -> None:
        self.plans: dict[str, tuple[int, Any]] = {}

    def get(self, name: str, generation: int, build) -> Any:
        entry = self.plans.get(name)
        if entry is not None and entry[0] == generation:
            return entry[1]
        plan = build()
        self.plans[name] = (generation, plan)
        return plan


class Version(dict):
    """One stored representation (component name -> QTensor/array); edits bump its store."""

    def __init__(self, store: WeightStore, components: dict[str, Any]):
        super().__init__(components)
        self.store = store

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.store.touch()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self.store.touch()

    def update(self, *args, **kw) -> None:
        super().update(*args, **kw)
        self.store.touch()


class Versions(dict):
    """name -> Version; adding, replacing or removing a version bumps the store."""

    def __init__(self, store: WeightStore):
        super().__init__()
        self.store = store

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, Version(self.store, value))
        self.store.touch()

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self.store.touch()

    def pop(self, *args):
        out = super().pop(*args)
        self.store.touch()
        return out


class WeightStore:
    """`master` is the float32 source of truth in the layer's offset layout (or None when the
    layer was loaded straight into a stored representation). `versions[scheme]` maps component
    names (poly.nn specs) to QTensors (matrices) and float32 arrays (vectors); `active` names the
    version the forward pass reads, None meaning the master.

    `generation` changes whenever the master object, the active version or any component of a
    version changes; `plans` caches what the forward passes derive from the weights, per
    generation (poly.nn plans, the fused step's arguments)."""

    def __init__(self, size: int, allocate: bool = True):
        if size < 0:
            raise LayerConfigError(f"weight count must be >= 0, got {size}")
        self.size = int(size)
        self.generation = Generations.bump()
        self.plans = PlanCache()
        self._master: np.ndarray | None = aligned_zeros(self.size) if allocate else None
        self.versions: dict[str, dict[str, Any]] = Versions(self)
        self._active: str | None = None

    def touch(self) -> None:
        """Record a change (plans built before it are rebuilt on next use)."""
        self.generation = Generations.bump()

    @property
    def master(self) -> np.ndarray | None:
        return self._master

    @master.setter
    def master(self, value: np.ndarray | None) -> None:
        self._master = value
        self.touch()

    @property
    def active(self) -> str | None:
        return self._active

    @active.setter
    def active(self, name: str | None) -> None:
        self._active = name
        self.touch()

    def plan(self, name: str, build) -> Any:
        """The plan `name` of these weights, built by `build()` when missing or stale."""
        return self.plans.get(name, self.generation, build)

    def set_version(
        self,
        name: str,
        components: dict[str, Any],
        *,
        activate: bool = True,
        drop_master: bool = False,
    ) -> None:
        self.versions[name] = dict(components)
        if activate:
            self.active = name
        if drop_master:
            self.master = None

    def activate(self, name: str | None) -> None:
        if name is not None and name not in self.versions:
            raise LayerConfigError(f"no weight version {name!r} (have {sorted(self.versions)})")
        if name is None and self.master is None:
            raise LayerConfigError("the float32 master of this layer was not allocated")
        self.active = name

    def ensure_master(self) -> np.ndarray:
        if self.master is None:
            self.master = aligned_zeros(self.size)
        return self.master

    def nbytes(self) -> int:
        """Bytes held now: the master (if any) plus every cached version."""
        total = 0 if self.master is None else self.master.nbytes
        for comps in self.versions.values():
            for value in comps.values():
                if value is not None:
                    total += int(getattr(value, "nbytes", 0))
        return total

"""Flat float32 weight storage plus cached stored representations per scheme."""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from poly.errors import LayerConfigError

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

"""Flat float32 weight storage plus cached stored representations per scheme."""

from __future__ import annotations

from typing import Any

import numpy as np

from poly.errors import LayerConfigError

ALIGN = 64


def aligned_zeros(n: int, dtype=np.float32, align: int = ALIGN) -> np.ndarray:
    """Zeroed 1-D array whose data pointer is a multiple of `align` bytes."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(n * itemsize + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + n * itemsize].view(dtype)


class WeightStore:
    """`master` is the float32 source of truth in the layer's offset layout (or None when the
    layer was loaded straight into a stored representation). `versions[scheme]` maps component
    names (poly.layout) to QTensors (matrices) and float32 arrays (vectors); `active` names the
    version the forward pass reads, None meaning the master."""

    def __init__(self, size: int, allocate: bool = True):
        if size < 0:
            raise LayerConfigError(f"weight count must be >= 0, got {size}")
        self.size = int(size)
        self.master: np.ndarray | None = aligned_zeros(self.size) if allocate else None
        self.versions: dict[str, dict[str, Any]] = {}
        self.active: str | None = None

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

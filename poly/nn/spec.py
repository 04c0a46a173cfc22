"""Parameter specs: [(role, shape)] in the order of a layer's flat float32 master."""

from __future__ import annotations

import numpy as np

from poly.errors import LayerConfigError

Spec = list[tuple[str, tuple[int, ...]]]


def offsets(spec: Spec) -> dict[str, tuple[int, int]]:
    """role -> (start, stop) in the flat master."""
    out, at = {}, 0
    for role, shape in spec:
        n = int(np.prod(shape, dtype=np.int64))
        out[role] = (at, at + n)
        at += n
    return out


def carve(master: np.ndarray | None, spec: Spec) -> dict[str, np.ndarray]:
    """Split the flat master into consecutive named views of the spec's shapes."""
    if master is None:
        raise LayerConfigError("this layer has no float32 master (loaded quantized)")
    return {
        role: master[a:b].reshape(shape)  # [*shape]
        for (role, shape), (a, b) in zip(spec, offsets(spec).values())
    }


def span(master: np.ndarray, spec: Spec, first: str, last: str) -> np.ndarray:
    """The contiguous master slice from role `first` through role `last` (fused projections)."""
    table = offsets(spec)
    return master[table[first][0] : table[last][1]]

"""Residual: input + skip. Inside a Sequential the skip is a named source (the block input or
a sub-layer's output), so [RMSNorm, MHA, Residual, ...] is a real pre-norm block."""

from __future__ import annotations

import numpy as np

from poly.layer import LayerKind, LayerType


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    if skip is None or skip.shape != x.shape:
        return x.copy()
    return x + skip


KIND = LayerKind(LayerType.RESIDUAL, forward)

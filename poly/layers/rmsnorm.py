"""RMSNorm: x / sqrt(mean(x^2) + eps) * gamma over the last axis (any leading shape)."""

from __future__ import annotations

import numpy as np

from poly import layout
from poly.ops import rms_norm


def forward(layer, x: np.ndarray, skip: np.ndarray | None = None) -> np.ndarray:
    return rms_norm(x, layout.components(layer)["gamma"], layer.rms_norm_eps)

"""Rotary position embeddings, HF half-split ("rotate half") convention."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from poly.config import RopeScaling
from poly.ops import HOOKS


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """float64 [head_dim/2] inverse frequencies, with Llama-3 scaling when given."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv
    # Llama-3: long wavelengths are divided by `factor`, short kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / scaling.factor + smooth * inv
    return np.where(mid, blended, scaled)


@lru_cache(maxsize=16)
def rope_tables(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_len: int, dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin `dtype` (float32, or float64 for the reference path) [max_len, head_dim/2],
    computed once in float64."""
    inv = inv_frequencies(head_dim, theta, scaling)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv[None, :]  # [max_len, hd/2]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [n, heads, hd]; cos/sin [n, hd/2] for the n positions. Pairs (i, i + hd/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # [n, 1, hd/2]
    out = np.empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out


def rope_inplace(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, start: int) -> np.ndarray:
    """Rotate a C-contiguous float32 x [n, heads, hd] in place for positions start..start+n-1,
    with the full cos/sin tables [max_len, hd/2]: one pass in C under the C backend, else numpy."""
    n, _, hd = x.shape
    fast = HOOKS["rope_inplace"]
    if fast is not None and x.flags.c_contiguous and x.dtype == np.float32:
        fast(x, cos, sin, int(start), n, hd)
    else:
        x[...] = apply_rope(x, cos[start : start + n], sin[start : start + n])
    return x

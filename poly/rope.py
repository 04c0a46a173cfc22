"""Rotary position embeddings, HF half-split ("rotate half") convention."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import numpy as np

from poly.config import RopeScaling
from poly.ops import HOOKS


def _plain(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def _linear(head_dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    # Positions divided by `factor` (the same angles as dividing the frequencies).
    return _plain(head_dim, theta) / s.factor, 1.0


def _llama3(head_dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    # Long wavelengths are divided by `factor`, short kept, a smooth ramp between.
    inv = _plain(head_dim, theta)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    return np.where(mid, blended, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    """transformers' _compute_yarn_parameters: interpolate the low frequencies, keep the high
    ones, a linear ramp between the dims set by beta_fast/beta_slow; cos/sin times a factor."""
    inv = _plain(head_dim, theta)
    orig = s.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times in `orig`
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast or 32), dim_of(s.beta_slow or 1)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against 0/0
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divided by factor)
    inv = inv / s.factor * (1 - keep) + inv * keep
    attention = s.attention_factor
    if attention is None and s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return inv, _yarn_mscale(s.factor) if attention is None else float(attention)


# rope_type -> (head_dim, theta, scaling) -> (float64 inverse frequencies, cos/sin multiplier)
ROPE_FREQUENCIES: dict[str, Callable[[int, float, RopeScaling], tuple[np.ndarray, float]]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[np.ndarray, float]:
    """float64 [head_dim/2] inverse frequencies and the factor cos and sin are multiplied by."""
    if scaling is None:
        return _plain(head_dim, theta), 1.0
    return ROPE_FREQUENCIES[scaling.rope_type](head_dim, theta, scaling)


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """float64 [head_dim/2] inverse frequencies, scaled when `scaling` is given."""
    return rope_frequencies(head_dim, theta, scaling)[0]


@lru_cache(maxsize=16)
def rope_tables(
    head_dim: int, theta: float, scaling: RopeScaling | None, max_len: int, dtype=np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin `dtype` (float32, or float64 for the reference path) [max_len, head_dim/2],
    computed once in float64, already times yarn's attention factor (every path reads these)."""
    inv, attention = rope_frequencies(head_dim, theta, scaling)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv[None, :]  # [max_len, hd/2]
    return (np.cos(angles) * attention).astype(dtype), (np.sin(angles) * attention).astype(dtype)


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

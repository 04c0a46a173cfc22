"""Rotary position embeddings: HF's half-split ("rotate half") pairs (i, i + dim/2) or GPT-J's
interleaved pairs (2i, 2i + 1), over a whole head or its first `dim` values (partial rotary)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from poly.errors import LayerConfigError
from poly.ops import HOOKS

# The fields each rotary scaling type needs; poly.rope.ROPE_FREQUENCIES computes each type.
# "dynamic" (NTK) and "longrope" depend on the length a call reaches (transformers recomputes
# them per forward from max(position) + 1), so their rows are computed per call, not tabled.
ROPE_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
    "dynamic": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling as transformers computes it (`rope_type` in ROPE_FIELDS)."""

    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    rope_type: str = "llama3"
    # yarn only; None means transformers' default (from factor / mscale, beta 32 and 1)
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope only: per-frequency divisors below / above original_max_position_embeddings
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                try:
                    value = tuple(float(v) for v in value)
                except (TypeError, ValueError):
                    raise LayerConfigError(
                        f"rope scaling {name} must be a list of numbers"
                    ) from None
                if not all(v > 0 and math.isfinite(v) for v in value):
                    raise LayerConfigError(f"rope scaling {name} must be positive")
                object.__setattr__(self, name, value)
        needs = ROPE_FIELDS.get(self.rope_type)
        if needs is None:
            raise LayerConfigError(
                f"rope scaling type {self.rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_FIELDS)})"
            )
        missing = [name for name in needs if getattr(self, name) is None]
        if missing:
            raise LayerConfigError(f"rope scaling {self.rope_type!r} needs {', '.join(missing)}")
        numbers = (self.factor, self.low_freq_factor, self.high_freq_factor, self.attention_factor)
        if not all(v > 0 and math.isfinite(v) for v in numbers if v is not None):
            raise LayerConfigError("rope scaling factors must be positive")
        if self.low_freq_factor is not None and self.high_freq_factor is not None:
            if self.high_freq_factor <= self.low_freq_factor:
                raise LayerConfigError("rope scaling needs high_freq_factor > low_freq_factor")
        orig = self.original_max_position_embeddings
        if orig is not None and orig <= 0:
            raise LayerConfigError("rope scaling needs original_max_position_embeddings > 0")


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


def _dynamic(head_dim: int, theta: float, s: RopeScaling, seq_len: int = 0):
    """transformers' dynamic NTK: past original_max_position_embeddings (transformers passes
    max_position_embeddings) the base grows with the length `seq_len` reached so far."""
    orig = s.original_max_position_embeddings
    seq = max(seq_len, orig)
    base = theta * ((s.factor * seq / orig) - (s.factor - 1)) ** (head_dim / (head_dim - 2))
    return _plain(head_dim, base), 1.0


def _longrope(head_dim: int, theta: float, s: RopeScaling, seq_len: int = 0):
    """transformers' longrope (Phi-3/4): frequencies divided per dim by the long factors once a
    call reaches past original_max_position_embeddings, else by the short ones; cos/sin times
    the attention factor (default sqrt(1 + ln(factor) / ln(original)))."""
    orig = s.original_max_position_embeddings
    factors = s.long_factor if seq_len > orig else s.short_factor
    if len(factors) != head_dim // 2:
        from poly.errors import LayerConfigError

        raise LayerConfigError(
            f"rope scaling longrope: {len(factors)} short/long factors for {head_dim // 2} "
            "rotary frequencies"
        )
    attention = s.attention_factor
    if attention is None:
        attention = 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(orig))
    # transformers builds the factors in float32 and divides in float32; so does this
    ext = np.asarray(factors, dtype=np.float32)
    shape = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv = 1.0 / (ext * np.float32(theta) ** shape)
    return inv.astype(np.float64), float(attention)


# rope_type -> (head_dim, theta, scaling) -> (float64 inverse frequencies, cos/sin multiplier)
ROPE_FREQUENCIES: dict[str, Callable[..., tuple[np.ndarray, float]]] = {
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
    "dynamic": _dynamic,
    "longrope": _longrope,
}


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, seq_len: int = 0
) -> tuple[np.ndarray, float]:
    """float64 [head_dim/2] inverse frequencies and the factor cos and sin are multiplied by;
    `seq_len`: the length a call reaches (dynamic and longrope only)."""
    if scaling is None:
        return _plain(head_dim, theta), 1.0
    if scaling.rope_type in LENGTH_DEPENDENT_ROPE:
        return ROPE_FREQUENCIES[scaling.rope_type](head_dim, theta, scaling, seq_len)
    return ROPE_FREQUENCIES[scaling.rope_type](head_dim, theta, scaling)


def rope_rows(
    head_dim: int, theta: float, scaling: RopeScaling | None, start: int, n: int, seq_len: int,
    dtype=np.float32,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """cos, sin [n, head_dim/2] of positions start..start+n-1 with the frequencies of a call that
    reaches `seq_len` (dynamic, longrope: computed per call as transformers does)."""
    inv, attention = rope_frequencies(head_dim, theta, scaling, seq_len)
    angles = np.arange(start, start + n, dtype=np.float64)[:, None] * inv[None, :]
    return (np.cos(angles) * attention).astype(dtype), (np.sin(angles) * attention).astype(dtype)


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


def apply_rope(
    x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool = False
) -> np.ndarray:
    """x [n, heads, dim]; cos/sin [n, dim/2] for the n positions. Pairs (i, i + dim/2), or
    (2i, 2i + 1) when `interleaved`."""
    c, s = cos[:, None, :], sin[:, None, :]  # [n, 1, dim/2]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x2 * c + x1 * s
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out


def rope_inplace(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    start: int,
    dim: int = 0,
    interleaved: bool = False,
) -> np.ndarray:
    """Rotate a C-contiguous x [n, heads, hd] in place for positions start..start+n-1, with
    cos/sin tables [>= start+n, dim/2], over the first `dim` values of each head (0: all): one
    pass in C under the C backend for whole float32 half-split heads, else numpy."""
    n, _, hd = x.shape
    dim = dim or hd
    fast = HOOKS["rope_inplace"]
    whole = dim == hd and not interleaved
    if whole and fast is not None and x.flags.c_contiguous and x.dtype == np.float32:
        fast(x, cos, sin, int(start), n, hd)
    else:
        part = x[..., :dim]
        part[...] = apply_rope(part, cos[start : start + n], sin[start : start + n], interleaved)
    return x

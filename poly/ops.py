"""Small numeric building blocks shared by the layer kinds (float32 in, float32 out; float64
in, float64 out for the high-precision reference path).

`HOOKS` holds the kernels a runtime backend may take over (dependency injection: this core
module never imports the runtime). The defaults are pure numpy; poly.runtime.kernels installs
the C or numba versions on `set_backend` and restores these for the numpy backend.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np


def numpy_dense_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, k] @ w.T for a float32 w [m, k] (BLAS)."""
    if out is None:
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    return np.matmul(x, w.T, out=out)


def numpy_silu_mul(
    gate_up: np.ndarray, out: np.ndarray, up: np.ndarray | None = None
) -> np.ndarray:
    """out [n, I] = silu(gate_up[:, :I]) * gate_up[:, I:], or silu(gate_up) * up."""
    inter = out.shape[1]
    out[...] = silu(gate_up[:, :inter])
    out *= gate_up[:, inter:] if up is None else up
    return out


HOOKS: dict[str, Callable] = {
    "dense_matmul": numpy_dense_matmul,
    "silu_mul": numpy_silu_mul,
    "rope_inplace": None,  # poly.rope's numpy rotation unless a backend installs one
    # prefill attention (q [n, H, hd], k/v [T, kvh, hd], start, groups) -> [n, H, hd] or None
    # (None: poly.nn.mha's numpy path runs)
    "attend": None,
    # one MoE expert (a SwiGLU layer) on its gathered rows x [n, d] -> [n, d] or None
    "expert": None,
}
NUMPY_HOOKS = dict(HOOKS)


def dense_matmul(x: np.ndarray, w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [n, k] @ w.T for a float32 w [m, k], by the backend in force."""
    return HOOKS["dense_matmul"](x, w, out)


def silu_mul(gate_up: np.ndarray, out: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    """out [n, I] = silu(gate) * up for gate_up [n, 2I] (or gate_up the gate and `up` apart,
    both [n, I]), by the backend in force."""
    return HOOKS["silu_mul"](gate_up, out, up)


def linear(x: np.ndarray, w, b: np.ndarray | None = None, block_rows: int = 0) -> np.ndarray:
    """x [n, in] @ W.T (+ b) -> [n, out] for a float32 array or any QTensor.

    `block_rows` > 0 computes the product over blocks of output rows (the tiled path).
    """
    if x.dtype == np.float64:
        out = x @ as_float64(w).T
    elif isinstance(w, np.ndarray) and w.dtype == np.float32:
        if block_rows > 0 and w.shape[0] > block_rows:
            out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
            for r0 in range(0, w.shape[0], block_rows):
                out[:, r0 : r0 + block_rows] = x @ w[r0 : r0 + block_rows].T
        else:
            out = dense_matmul(np.ascontiguousarray(x, dtype=np.float32), w)
    else:
        from poly.quant.qtensor import as_qtensor

        qt = as_qtensor(w)
        if block_rows > 0:
            qt.block_rows = block_rows
        out = qt.matmul(x)
    if b is not None and b.any():  # most checkpoints have no bias: skip the pass
        out += b
    return out


def as_float64(w) -> np.ndarray:
    """A weight (array or QTensor) upcast to float64 (the high-precision reference path)."""
    if isinstance(w, np.ndarray):
        return w.astype(np.float64)
    from poly.quant.qtensor import as_qtensor

    qt = as_qtensor(w)
    return qt.dequantize(0, qt.shape[0]).astype(np.float64)


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * gamma over the last axis, any leading shape (float64 stays
    float64, anything else computes in float32)."""
    dt = np.float64 if getattr(x, "dtype", None) == np.float64 else np.float32
    x = np.asarray(x, dtype=dt)
    # einsum sums the squares without a temporary (measured 40 vs 65 us for [128, 576])
    var = np.einsum("...i,...i->...", x, x)[..., None] / dt(x.shape[-1])
    out = x * (dt(1.0) / np.sqrt(var + dt(eps)))
    out *= gamma
    return out


def silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x), float32; exp(-x) overflows only for x < -88; one buffer, no temporaries
    t = np.maximum(x, np.float32(-88.0))
    np.negative(t, out=t)
    np.exp(t, out=t)
    t += np.float32(1.0)
    return np.divide(x, t, out=t)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


@functools.cache
def _erf_pieces() -> np.ndarray:
    """Power-basis coefficients [6, 19] of erf on [p, p+1], p = 0..5, in t = 2(x-p)-1: Chebyshev
    interpolants of math.erf (numpy has no erf and scipy is not a dependency); max error 3e-15."""
    from numpy.polynomial import chebyshev as C  # imported for exact GELU (gelu_erf) only

    exact = np.vectorize(math.erf)
    pieces = [C.Chebyshev.interpolate(exact, 18, domain=[p, p + 1]).coef for p in range(6)]
    return np.array([C.cheb2poly(c) for c in pieces])


def erf(x: np.ndarray) -> np.ndarray:
    """erf elementwise in float64 (any input dtype); erf(|x| >= 6) is +-1 in float64."""
    ax = np.fmin(np.abs(np.asarray(x, dtype=np.float64)), 6.0)  # [*]; NaN -> 6, put back below
    piece = np.minimum(ax.astype(np.int64), 5)
    coef = _erf_pieces()
    t = 2.0 * (ax - piece) - 1.0
    out = coef[piece, -1]
    for k in range(coef.shape[1] - 2, -1, -1):  # Horner in t, per element's own piece
        out *= t
        out += coef[piece, k]
    out = np.copysign(np.minimum(out, 1.0), x)  # the interpolant overshoots 1 by 2e-15 at 6
    nan = np.isnan(x)
    return np.where(nan, np.nan, out) if nan.any() else out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh form (HF gelu_new / gelu_pytorch_tanh, Loom's GELU) in x's dtype: Python-float
    constants take the array's precision (float32 stays float32, float64 keeps every digit)."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1.0 + np.tanh(inner))


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """Exact GELU, x * (1 + erf(x / sqrt 2)) / 2, in x's dtype (erf itself runs in float64)."""
    return (0.5 * x * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))).astype(x.dtype, copy=False)


ACTIVATIONS = {
    -1: lambda x: x,
    0: lambda x: np.maximum(x, np.float32(0)),
    1: silu,
    2: gelu_tanh,
    3: np.tanh,
    4: lambda x: np.float32(1) / (np.float32(1) + np.exp(-x)),
    5: lambda x: np.where(x > 0, x, np.float32(0.01) * x).astype(np.float32),
    6: lambda x: np.square(np.maximum(x, np.float32(0))),
    7: gelu_erf,
}

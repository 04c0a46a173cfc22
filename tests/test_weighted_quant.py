"""Importance-weighted quantizers (poly.quant.weighted): their blocks are GGUF's own layout, as
gguf-py's reference dequantize reads them and as our C kernels run them."""

from __future__ import annotations

import numpy as np
import pytest

from poly.quant.ggml import GGMLType
from poly.quant.weighted import WEIGHTED_TYPES, quantize


def _matrix(kind, seed=0):
    rng = np.random.default_rng(seed)
    n_in = 512 if kind in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) else 96
    w = (rng.standard_normal((24, n_in)) * 0.05).astype(np.float32)
    w[3, 5] = 0.9  # an outlier and an all-zero row: the edge cases of the scale search
    w[7] = 0.0
    imx = (rng.random(n_in) ** 4 * 10).astype(np.float32)
    return w, imx


@pytest.mark.parametrize("kind", WEIGHTED_TYPES, ids=lambda k: k.name)
def test_blocks_read_back_by_gguf_py(kind):
    from gguf import GGMLQuantizationType, quants

    w, imx = _matrix(kind)
    raw, deq = quantize(w, kind, imx)
    ref = quants.dequantize(raw, GGMLQuantizationType(int(kind))).reshape(w.shape)
    np.testing.assert_array_equal(ref, deq)  # the quantizer's own view = the format's
    assert np.all(deq[7] == 0)
    rel = np.sqrt(np.square(w - deq).mean() / np.square(w).mean())
    assert rel < {GGMLType.Q8_0: 0.01, GGMLType.Q6_K: 0.05}.get(kind, 0.15)


@pytest.mark.parametrize("kind", WEIGHTED_TYPES, ids=lambda k: k.name)
def test_blocks_run_by_our_kernels(kind):
    from poly.quant.qtensor import GGUFMatrix
    from poly.runtime import ckernels

    w, imx = _matrix(kind, seed=1)
    raw, deq = quantize(w, kind, imx)
    m = GGUFMatrix(raw, int(kind), w.shape)
    x = np.random.default_rng(2).standard_normal((3, w.shape[1])).astype(np.float32)
    want = x.astype(np.float64) @ deq.T.astype(np.float64)
    got = ckernels.matmul(m, x, q8=False)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_importance_moves_error_off_weighted_channels():
    """Against gguf-py's own (unweighted) Q4_0 quantizer, ours has a smaller error where the
    importance matrix is large: the point of weighting."""
    from gguf import GGMLQuantizationType, quants

    w, imx = _matrix(GGMLType.Q4_0, seed=4)
    ref = quants.dequantize(quants.quantize(w, GGMLQuantizationType.Q4_0), 2).reshape(w.shape)
    _, deq = quantize(w, GGMLType.Q4_0, imx)
    weighted = lambda d: float(np.square(w - d).sum(axis=0) @ imx)  # noqa: E731
    assert weighted(deq) < 0.9 * weighted(ref)


# (Q8_0's rounding error is the size of its f16 scale rounding: nothing to check there)
@pytest.mark.parametrize("kind", [GGMLType.Q4_0, GGMLType.Q5_0], ids=lambda k: k.name)
def test_block_scale_is_least_squares_for_its_codes(kind):
    """The written scale of each symmetric block is (up to its f16 rounding) the
    importance-weighted least-squares scale of the codes it holds: refitting d to the stored
    codes cannot lower Σ w (x - d q)², which llama.cpp's candidate search alone leaves open."""
    from gguf import GGMLQuantizationType, quants

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    imx = (rng.random(256) ** 4 * 10).astype(np.float32)
    raw, deq = quantize(w, kind, imx)
    assert np.array_equal(
        quants.dequantize(raw, GGMLQuantizationType(int(kind))).reshape(w.shape), deq
    )
    d = raw.reshape(-1, raw.shape[1] // 8)[:, :2].copy().view(np.float16).astype(np.float64)
    q = (deq.reshape(-1, 32) / np.where(d != 0, d, 1.0)).astype(np.float64)  # the stored codes
    x = w.reshape(-1, 32).astype(np.float64)
    sig = np.repeat((w.astype(np.float64) ** 2).mean(axis=1, keepdims=True), 8, axis=0)
    wt = np.tile(imx, 64).reshape(-1, 32) * np.sqrt(sig + x * x)  # llama.cpp's weighting
    ls = (wt * q * x).sum(1) / np.maximum((wt * q * q).sum(1), 1e-30)
    err = lambda s: (wt * (x - s[:, None] * q) ** 2).sum(1)  # noqa: E731
    gain = err(d[:, 0]) - err(ls)
    # what is left is the f16 rounding of d (relative 2^-11), never a worse scale
    assert np.all(gain <= 2e-3 * err(d[:, 0]) + 1e-12), gain.max()

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

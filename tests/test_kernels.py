"""Compiled kernels (poly.runtime.kernels) against the numpy reference path x @ dequantize().T."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from poly.errors import UsageError
from poly.quant import qtensor
from poly.quant.qtensor import CodedMatrix, DenseMatrix, GGUFMatrix, Q4Matrix
from poly.runtime import kernels

pytestmark = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="numba not installed")

ROWS = (1, 37, 130)  # odd counts: the parallel row split has a ragged tail
N_IN = (1, 4)


@pytest.fixture(autouse=True)
def numba_backend():
    kernels.set_backend("numba")
    yield
    kernels.set_backend()


def _weights(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)) * rng.uniform(0.01, 2.0, (m, 1))).astype(np.float32)


def _gguf(kind):
    def make(w):
        raw = quants.quantize(w, kind)
        return GGUFMatrix(raw, kind, w.shape)

    return make


MAKERS = {
    "float32": DenseMatrix,
    "float16": lambda w: DenseMatrix(w.astype(np.float16)),
    "int8": lambda w: CodedMatrix.encode(w, "int8"),
    "loom_q4": Q4Matrix.quantize,
    "gguf_q4_0": _gguf(GGMLQuantizationType.Q4_0),
    "gguf_q4_1": _gguf(GGMLQuantizationType.Q4_1),
    "gguf_q8_0": _gguf(GGMLQuantizationType.Q8_0),
}


@pytest.mark.parametrize("scheme", sorted(MAKERS))
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n", N_IN)
def test_kernel_matches_numpy(scheme, m, n):
    k = 96
    qt = MAKERS[scheme](_weights(m, k, seed=m * 7 + n))
    assert qt.scheme == scheme and scheme in qtensor.KERNELS
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T  # [n, m]
    got = qt.matmul(x)
    assert got.dtype == np.float32 and got.shape == (n, m)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("scheme", sorted(MAKERS))
def test_vector_input_and_out_buffer(scheme):
    qt = MAKERS[scheme](_weights(33, 64, seed=3))
    x = np.random.default_rng(5).standard_normal(64).astype(np.float32)
    out = np.full(33, np.nan, dtype=np.float32)
    assert qt.matmul(x, out=out) is out
    ref = qt.dequantize() @ x
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_many_rows_take_the_blas_path_with_same_result():
    qt = MAKERS["gguf_q4_1"](_weights(40, 64, seed=9))
    x = np.random.default_rng(1).standard_normal((kernels.SMALL_N + 3, 64)).astype(np.float32)
    ref = x @ qt.dequantize().T
    np.testing.assert_allclose(qt.matmul(x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_loom_q4_with_rows_straddling_blocks_falls_back():
    qt = Q4Matrix.quantize(_weights(7, 40, seed=2))  # 40 % 32 != 0
    x = np.random.default_rng(2).standard_normal((1, 40)).astype(np.float32)
    np.testing.assert_allclose(qt.matmul(x), x @ qt.dequantize().T, rtol=1e-5, atol=1e-6)


def test_float16_widening_is_exact_for_every_bit_pattern():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    w = bits.view(np.float16)
    out = np.empty((1, 256), dtype=np.float32)
    want = w.astype(np.float32)
    for j in (0, 1, 255):  # a one-hot x picks one column: out = w[:, j] exactly
        x = np.zeros((1, 256), dtype=np.float32)
        x[0, j] = 1.0
        kernels.mm_f16(x, bits, out)
        col = want[:, j]
        finite = np.isfinite(col)
        np.testing.assert_array_equal(out[0, finite], col[finite])
        assert np.isnan(out[0, ~finite]).all()  # inf * 0 in the sum gives nan, as in BLAS


def test_nan_weights_propagate():
    w = _weights(5, 64, seed=4)
    w[2, 10] = np.nan
    x = np.ones((1, 64), dtype=np.float32)
    got = DenseMatrix(w).matmul(x)
    assert np.isnan(got[0, 2]) and np.isfinite(np.delete(got[0], 2)).all()


def test_dense_matmul_matches_blas():
    w = _weights(77, 100, seed=6)
    for n in (1, 3, 40):
        x = np.random.default_rng(n).standard_normal((n, 100)).astype(np.float32)
        ref = x @ w.T
        got = kernels.dense_matmul(x, w)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_backend_selection(monkeypatch):
    assert kernels.set_backend("numpy") == "numpy"
    assert "gguf_q4_1" not in qtensor.KERNELS
    monkeypatch.setenv("POLY_BACKEND", "numba")
    assert kernels.set_backend() == "numba" and "gguf_q4_1" in qtensor.KERNELS
    with pytest.raises(UsageError):
        kernels.set_backend("cuda")


def test_thread_count():
    old = kernels.num_threads()
    try:
        assert kernels.set_num_threads(1) == 1
        with pytest.raises(UsageError):
            kernels.set_num_threads(-2)
    finally:
        kernels.set_num_threads(old)

"""MXFP4 (GGUF type 39, GPT-OSS's experts) read by the C kernels from its stored blocks.

References we did not write: gguf-py's `quants.dequantize` (llama.cpp's own Python package) for
the values, float64 products of those values for the matrix kernels, and llama.cpp's quantizer
(its MXFP4_MOE preset) for blocks as real files hold them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from poly.quant.ggml import dequantize_mxfp4
from poly.quant.qtensor import GGUFMatrix
from poly.runtime import ckernels

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]
MXFP4 = GGMLQuantizationType.MXFP4
K = 512  # 16 blocks a row


def _every_scale(seed: int) -> np.ndarray:
    """256 rows, row e's blocks all with the e8m0 exponent e, random codes."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (256, K // 32, 17), np.uint8)
    raw[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    return raw.reshape(256, -1)


def _gguf_py(raw: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exponent 255 times 12 overflows, in ggml too
        return np.asarray(quants.dequantize(raw, MXFP4), np.float32).reshape(raw.shape[0], K)


def test_numpy_decoder_equals_gguf_py_for_every_scale():
    raw = _every_scale(0)
    np.testing.assert_array_equal(dequantize_mxfp4(raw, K), _gguf_py(raw))


def test_c_dequantize_bitwise_for_every_scale(each_isa):
    raw = _every_scale(1)
    qt = GGUFMatrix(raw, MXFP4, (256, K))
    got = ckernels.dequantize(qt, 0, 256)
    np.testing.assert_array_equal(got.view(np.uint32), _gguf_py(raw).view(np.uint32))


@pytest.mark.parametrize("n", (1, 2, 5, 16, 40))  # one row, tiles, a remainder, gemm panels
def test_product_equals_dequantize_then_matmul_for_every_scale(n, each_isa, float_path):
    """Each exponent's row within float32 rounding of sum |x w| (the float path: q8 off); x at
    three magnitudes so that every row whose values are finite (all but exponents 253-255 with a
    code of 12) has sums inside float32 in one of them."""
    raw = _every_scale(n)
    w = _gguf_py(raw).astype(np.float64)  # [256, K]
    finite = np.isfinite(w).all(axis=1)
    w0, wa = np.where(finite[:, None], w, 0), np.where(finite[:, None], np.abs(w), 0)
    qt = GGUFMatrix(raw, MXFP4, (256, K))
    covered = np.zeros(256, bool)
    for scale in (1.0, 2.0**-100, 2.0**100):
        x = (np.random.default_rng(n).standard_normal((n, K)) * scale).astype(np.float32)
        got = qt.matmul(x)  # the registered kernel (rows, or gemm past GEMM_ROWS)
        ref = x.astype(np.float64) @ w0.T
        bound = 2e-6 * (np.abs(x).astype(np.float64) @ wa.T)  # [n, 256]
        rows = finite & (bound.max(axis=0) < 1e32) & (bound.min(axis=0) > 1e-30)
        err = np.abs(got - ref)[:, rows]
        assert (err <= bound[:, rows]).all(), (scale, float((err / bound[:, rows]).max()))
        covered |= rows
    assert covered.sum() >= 253


def test_auto_mode_int8_rows_close(each_isa):
    """The default mode's decode rows take x's int8 codes (as IQ4_NL's): x's rounding, ~5e-3."""
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (96, K // 32, 17), np.uint8)
    raw[:, :, 0] = rng.integers(118, 130, (96, K // 32))
    raw = raw.reshape(96, -1)
    w = _gguf_py(raw).astype(np.float64)
    qt = GGUFMatrix(raw, MXFP4, (96, K))
    for n in (1, 4):
        x = rng.standard_normal((n, K)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T
        got = ckernels.matmul(qt, x)
        assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()

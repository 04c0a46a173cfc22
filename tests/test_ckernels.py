"""C kernels (poly.runtime.ckernels / poly.runtime.native.ckernels) against the numpy reference x @ dequantize().T."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from poly.errors import DTypeError, LayerConfigError, UsageError
from poly.quant import qtensor
from poly.quant.qtensor import CodedMatrix, DenseMatrix, GGUFMatrix, Q4Matrix
from poly.runtime import ckernels, kernels

pytestmark = [
    pytest.mark.skipif(not ckernels.AVAILABLE, reason="poly.runtime.native.ckernels not built"),
    pytest.mark.usefixtures("c_backend"),
]

_T = GGMLQuantizationType
K_TYPES = {  # types gguf-py cannot quantize: (block elements, bytes, byte offsets of the f16 scales)
    _T.Q2_K: (256, 84, (80, 82)),
    _T.Q3_K: (256, 110, (108,)),
    _T.Q4_K: (256, 144, (0, 2)),
    _T.Q5_K: (256, 176, (0, 2)),
    _T.Q6_K: (256, 210, (208,)),
    _T.IQ4_NL: (32, 18, (0,)),
    _T.IQ4_XS: (256, 136, (0,)),
}


def random_weights(m: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)) * rng.uniform(0.01, 2.0, (m, 1))).astype(np.float32)


def _gguf(kind):
    return lambda w: GGUFMatrix(quants.quantize(w, kind), kind, w.shape)


def _gguf_dense(dtype, kind):
    return lambda w: GGUFMatrix(w.astype(dtype).view(np.uint8), kind, w.shape)


def _kquant(kind):
    """Random blocks (gguf-py cannot quantize these kinds) with sane f16 super-block scales."""

    def make(w):
        m, k = w.shape
        block, size, offs = K_TYPES[kind]
        rng = np.random.default_rng(m + k)
        raw = rng.integers(0, 256, (m, k // block, size), dtype=np.uint8)  # [m, blocks, bytes]
        d = rng.uniform(1e-3, 1e-2, (m, k // block)).astype(np.float16).view(np.uint8)
        for o in offs:
            raw[:, :, o : o + 2] = d.reshape(m, k // block, 2)
        return GGUFMatrix(raw.reshape(m, -1), kind, (m, k))

    return make


MAKERS = {
    "float32": DenseMatrix,
    "float16": lambda w: DenseMatrix(w.astype(np.float16)),
    "bfloat16": lambda w: DenseMatrix(w.astype(ml_dtypes.bfloat16)),
    "int8": lambda w: CodedMatrix.encode(w, "int8"),
    "loom_q4": Q4Matrix.quantize,
    "gguf_q4_0": _gguf(GGMLQuantizationType.Q4_0),
    "gguf_q4_1": _gguf(GGMLQuantizationType.Q4_1),
    "gguf_q8_0": _gguf(GGMLQuantizationType.Q8_0),
    "gguf_q5_0": _gguf(_T.Q5_0),
    "gguf_q5_1": _gguf(_T.Q5_1),
    **{"gguf_" + t.name.lower(): _kquant(t) for t in K_TYPES},
    "gguf_f32": _gguf_dense(np.float32, _T.F32),
    "gguf_f16": _gguf_dense(np.float16, _T.F16),
    "gguf_bf16": _gguf_dense(ml_dtypes.bfloat16, _T.BF16),
}
FLOATS = ("float32", "float16", "bfloat16", "gguf_f32", "gguf_f16", "gguf_bf16")
QUANTIZED = [s for s in MAKERS if s not in FLOATS]


def block_of(scheme: str) -> int:
    """Elements per block of a stored form (rows must be a multiple)."""
    if not scheme.startswith("gguf_"):
        return 32
    return quants.GGML_QUANT_SIZES[_T[scheme[5:].upper()]][0]


def kernel_case(scheme, m, n, seed=0):
    k = 512 if block_of(scheme) == 256 else 96  # K-quants need multiples of 256
    qt = MAKERS[scheme](random_weights(m, k, seed=m * 7 + n + seed))
    x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
    ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T  # [n, m]
    return qt, x, ref


@pytest.mark.parametrize("scheme", sorted(MAKERS))
@pytest.mark.parametrize("m", (1, 37, 130))  # ragged tails of the parallel row split
@pytest.mark.parametrize("n", (1, 3, 16))
def test_kernel_matches_numpy(scheme, m, n, float_path):
    qt, x, ref = kernel_case(scheme, m, n)
    assert qt.scheme == scheme and ckernels.supports(qt)
    got = ckernels.matmul(qt, x, q8=False)
    assert got.dtype == np.float32 and got.shape == (n, m)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(qt.matmul(x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize(
    "scheme",
    ["loom_q4", "gguf_q4_0", "gguf_q4_1", "gguf_q8_0", "gguf_q4_k", "float32", "float16", "int8"],
)
def test_a_row_is_the_same_in_a_pair_and_alone(scheme, each_isa, float_path):
    """Several input rows take the weight rows in pairs (AVX-512: one x load, four FMAs) and an
    odd row alone (the fused step's thread split decides which); dense rows in quads: rows
    16-19 of 37 run together, each as a 1-row matrix alone; their sums must be bitwise the
    same."""
    w = random_weights(37, 512, seed=5)
    x = np.random.default_rng(11).standard_normal((11, 512)).astype(np.float32)
    qt = MAKERS[scheme](w)
    full = ckernels.matmul(qt, x, q8=False)  # [11, 37]
    ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T
    np.testing.assert_allclose(full, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    for r in (16, 17, 18, 19, 36):  # a quad of dense rows, a pair of quantized ones, the last
        if isinstance(qt, GGUFMatrix):  # the row's own bytes
            one = GGUFMatrix(qt.raw[r : r + 1].copy(), qt.ggml_type, (1, 512))
        else:  # dense rows, int8 row scales, Loom blocks of 32 within a row: the same values
            one = MAKERS[scheme](w[r : r + 1])
        alone = ckernels.matmul(one, x, q8=False)  # [11, 1]
        np.testing.assert_array_equal(alone[:, 0], full[:, r])


@pytest.mark.parametrize("scheme", QUANTIZED)
@pytest.mark.parametrize("n", (1, 3, 16))
def test_int8_activation_scheme_stays_within_2e_3(scheme, n):
    qt, x, ref = kernel_case(scheme, 67, n, seed=1)
    x[:, 3] *= 30.0  # an outlier channel, as in real activations
    ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T
    got = ckernels.matmul(qt, x, q8=True)
    assert np.abs(got - ref).max() <= 2e-3 * np.abs(ref).max()
    assert np.linalg.norm(got - ref) <= 2e-3 * np.linalg.norm(ref)


def test_act_q8_flag_routes_the_registered_kernel(float_path):
    qt, x, ref = kernel_case("gguf_q4_1", 40, 1)
    exact = qt.matmul(x)
    ckernels.set_act_q8(True)
    approx = qt.matmul(x)
    assert not np.array_equal(exact, approx)  # the integer path really ran
    np.testing.assert_allclose(approx, ref, atol=2e-3 * np.abs(ref).max())


def test_float16_and_bfloat16_widening_is_exact():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    for store in (np.float16, ml_dtypes.bfloat16):
        w = bits.view(store)
        want = w.astype(np.float32)
        for j in (0, 1, 255):  # a one-hot x picks one column exactly
            x = np.zeros((1, 256), dtype=np.float32)
            x[0, j] = 1.0
            got = ckernels.matmul(DenseMatrix(w), x)[0]
            fin = np.isfinite(want).all(axis=1)  # a row holding inf/nan sums inf * 0 = nan
            np.testing.assert_array_equal(got[fin], want[fin, j])
            assert np.isnan(got[~fin]).all()


@pytest.mark.parametrize("q8", (False, True))
def test_nan_propagates(q8):
    qt = MAKERS["gguf_q8_0"](random_weights(5, 64, seed=4))
    x = np.ones((1, 64), dtype=np.float32)
    x[0, 7] = np.nan
    assert np.isnan(ckernels.matmul(qt, x, q8=q8)).all()
    w = random_weights(5, 64, seed=4)
    w[2, 10] = np.nan
    got = ckernels.matmul(DenseMatrix(w), np.ones((1, 64), dtype=np.float32))
    assert np.isnan(got[0, 2]) and np.isfinite(np.delete(got[0], 2)).all()


def test_dense_matmul_odd_k_and_many_rows():
    w = random_weights(77, 101, seed=6)
    for n in (1, 3, 16, 40):  # 40 > MAX_N: BLAS
        x = np.random.default_rng(n).standard_normal((n, 101)).astype(np.float32)
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        got = kernels.dense_matmul(x, w)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("scheme", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("k", [101, 1100])  # a scalar tail; past 1,024 the row pieces are 4 rows
def test_dense_register_tiles_every_row_count(scheme, k, each_isa):
    """Dense rows times 1..16 input rows: tiles of 8/4/2/1 rows (AVX2: 4/2/1), pieces of rows
    that stay in L1, the k tail; every count equals the float64 product."""
    qt = MAKERS[scheme](random_weights(37, k, seed=k))
    w = qt.dequantize().astype(np.float64)
    for n in range(1, 17):
        x = np.random.default_rng(n).standard_normal((n, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T
        got = ckernels.matmul(qt, x, q8=False)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_bad_inputs_raise_typed_errors():
    qt = MAKERS["gguf_q4_1"](random_weights(8, 64, seed=1))
    x = np.ones((2, 64), dtype=np.float32)
    with pytest.raises(DTypeError):
        ckernels.matmul(qt, x.astype(np.float64))
    with pytest.raises(LayerConfigError):
        ckernels.matmul(qt, np.ones((2, 128), dtype=np.float32)[:, ::2])  # not contiguous
    with pytest.raises(LayerConfigError):
        ckernels.matmul(qt, np.ones((2, 32), dtype=np.float32))  # wrong k
    with pytest.raises(LayerConfigError):
        ckernels.matmul(qt, np.ones((17, 64), dtype=np.float32))  # more rows than MAX_N
    with pytest.raises(LayerConfigError):
        ckernels.matmul(qt, x, out=np.empty((2, 9), dtype=np.float32))
    with pytest.raises(LayerConfigError):
        ckernels.matmul(qt, x, out=np.empty((2, 16), dtype=np.float32)[:, ::2])
    with pytest.raises(LayerConfigError):
        ckernels.matmul(
            Q4Matrix.quantize(random_weights(3, 40, seed=2)), np.ones((1, 40), np.float32)
        )


def test_extension_checks_buffer_sizes_itself():
    """Even a call that skips the Python checks cannot read past a buffer."""
    _ckernels = ckernels.EXT

    w = np.zeros((4, 64), dtype=np.float32)
    out = np.zeros((1, 4), dtype=np.float32)
    with pytest.raises(ValueError):
        _ckernels.matmul(ckernels.F32, np.ones((1, 63), np.float32), out, w, None, 1, 64, 4, False)
    with pytest.raises(ValueError):
        _ckernels.matmul(ckernels.Q4_1, np.ones((1, 64), np.float32), out, w, None, 1, 64, 4, False)
    with pytest.raises(ValueError):
        _ckernels.matmul(ckernels.I8, np.ones((1, 64), np.float32), out, w, None, 1, 64, 4, False)
    with pytest.raises((ValueError, BufferError)):  # numpy refuses a C-contiguous view
        _ckernels.matmul(
            ckernels.F32, np.ones((1, 64), np.float32), out, w[:, ::2], None, 1, 32, 4, 0
        )


def test_non_contiguous_weights_take_the_numpy_path():
    w = random_weights(20, 64, seed=8)
    qt = DenseMatrix(np.asfortranarray(w))
    assert not ckernels.supports(qt)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(qt.matmul(x), x @ w.T, rtol=1e-5, atol=1e-5)


def test_backend_selection(monkeypatch):
    assert kernels.set_backend("numpy") == "numpy" and "gguf_q4_1" not in qtensor.KERNELS
    assert kernels.set_backend("c") == "c" and qtensor.KERNELS["gguf_q4_1"] is ckernels.kernel
    monkeypatch.setenv("POLY_BACKEND", "c")
    assert kernels.set_backend() == "c"
    monkeypatch.setenv("POLY_BACKEND", "auto")
    assert kernels.set_backend() == "c"
    with pytest.raises(UsageError):
        kernels.set_backend("cuda")


def test_threads_drive_openmp():
    old = kernels.num_threads()
    try:
        kernels.set_num_threads(1)
        assert ckernels.info()["threads"] == 1
        qt, x, ref = kernel_case("gguf_q4_0", 130, 3)
        np.testing.assert_allclose(qt.matmul(x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    finally:
        kernels.set_num_threads(old)


def test_numba_is_not_imported_unless_selected():
    code = (
        "import sys, poly.runtime.kernels as k, entity, lucy.cli\n"
        "assert k.backend() == 'c', k.backend()\n"
        "assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules\n"
    )
    env_run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert env_run.returncode == 0, env_run.stderr


# --- C dequantize (prefill tiles) against references we did not write ---------------------------

_GGUF_TYPES = {s: _T[s[5:].upper()] for s in MAKERS if s.startswith("gguf_")}


def _loom_q4_reference(qt: Q4Matrix, a: int, b: int) -> np.ndarray:
    """Loom Q4 in plain numpy: element e = signed nibble e%32 of block e//32 times its scale."""
    k = qt.shape[1]
    e = np.arange(a * k, b * k)
    byte = qt.packed.reshape(-1)[(e // 32) * 16 + (e % 32) // 2].astype(np.int32)
    nib = np.where(e % 2 == 1, byte >> 4, byte & 15)
    code = np.where(nib >= 8, nib - 16, nib).astype(np.float32)
    return (code * qt.scales[e // 32]).reshape(b - a, k)


def _dequant_reference(scheme: str, qt, a: int, b: int) -> np.ndarray:
    if a == b:  # gguf-py cannot decode zero blocks
        return np.empty((0, qt.shape[1]), np.float32)
    if scheme in _GGUF_TYPES:
        vals = quants.dequantize(qt.raw[a:b], _GGUF_TYPES[scheme])  # gguf-py's numpy decoder
        return np.asarray(vals, np.float32).reshape(b - a, qt.shape[1])
    if scheme == "int8":
        enc = qt.encoded
        return enc.codes[a:b].astype(np.float32) * enc.scales[a:b, None]
    if scheme == "loom_q4":
        return _loom_q4_reference(qt, a, b)
    return qt.array[a:b].astype(np.float32)  # float32/float16/bfloat16 widening is exact


@pytest.mark.parametrize("scheme", sorted(MAKERS))
@pytest.mark.parametrize("threads", (1, 2))
def test_dequantize_is_bitwise_equal_to_the_reference(scheme, threads):
    k = 512
    qt = MAKERS[scheme](random_weights(67, k, seed=3))
    for a, b in ((0, 67), (5, 66), (13, 14), (66, 67), (0, 1), (40, 40)):
        got = ckernels.dequantize(qt, a, b, threads=threads)
        assert got is not None and got.shape == (b - a, k) and got.dtype == np.float32
        ref = _dequant_reference(scheme, qt, a, b)
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("k", (40, 72, 33))  # 32-blocks straddle rows
def test_dequantize_loom_q4_blocks_across_rows(k):
    qt = Q4Matrix.quantize(random_weights(11, k, seed=k))
    for a, b in ((0, 11), (3, 8), (10, 11)):
        got = ckernels.dequantize(qt, a, b)
        np.testing.assert_array_equal(
            got.view(np.uint32), _loom_q4_reference(qt, a, b).view(np.uint32)
        )
    np.testing.assert_array_equal(qt.dequantize(2, 9), qt._rows_numpy(2, 9))


def test_dequantize_writes_into_a_tile_buffer():
    qt = MAKERS["gguf_q4_1"](random_weights(50, 256, seed=4))
    buf = np.full((32, 256), np.nan, np.float32)
    got = ckernels.dequantize(qt, 20, 45, buf)
    assert np.shares_memory(got, buf) and got.shape == (25, 256)
    np.testing.assert_array_equal(got, _dequant_reference("gguf_q4_1", qt, 20, 45))
    assert np.isnan(buf[25:]).all()  # rows past the range untouched


@pytest.mark.parametrize("scheme", sorted(MAKERS))
def test_prefill_tiles_match_the_dequantized_product(scheme, monkeypatch, float_path):
    """More than MAX_N input rows: C-dequantized tiles + sgemm == x @ W.T of the reference W."""
    m, k, n = 300, 256, 40
    qt = MAKERS[scheme](random_weights(m, k, seed=5))
    monkeypatch.setattr(qtensor, "_TILE_BYTES", 64 * k * 4)  # several tiles, a ragged last one
    x = np.random.default_rng(6).standard_normal((n, k)).astype(np.float32)
    ref = x.astype(np.float64) @ _dequant_reference(scheme, qt, 0, m).astype(np.float64).T
    got = qt.matmul(x)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_dequantize_bad_inputs_raise_typed_errors():
    qt = MAKERS["gguf_q8_0"](random_weights(8, 64, seed=7))
    with pytest.raises(LayerConfigError):
        ckernels.dequantize(qt, 3, 2)
    with pytest.raises(LayerConfigError):
        ckernels.dequantize(qt, 0, 9)
    with pytest.raises(DTypeError):
        ckernels.dequantize(qt, 0, 2, np.empty((2, 64), np.float64))
    with pytest.raises(LayerConfigError):
        ckernels.dequantize(qt, 0, 4, np.empty((3, 64), np.float32))
    with pytest.raises(LayerConfigError):
        ckernels.dequantize(qt, 0, 2, np.empty((4, 128), np.float32)[:, ::2])
    with pytest.raises(LayerConfigError):
        ckernels.dequantize(qt, 0, 2, threads=-1)
    assert ckernels.dequantize(DenseMatrix(np.ones((2, 3), np.float32)[:, ::2]), 0, 1) is None


def test_dequantize_extension_checks_sizes_itself():
    _ckernels = ckernels.EXT

    raw = np.zeros((4, 34 * 2), np.uint8)  # Q8_0 [4, 64]
    out = np.empty((2, 64), np.float32)
    with pytest.raises(ValueError):
        _ckernels.dequantize(ckernels.Q8_0, raw[:3], None, 4, 64, 0, 2, out, 0)  # short weights
    with pytest.raises(ValueError):
        _ckernels.dequantize(ckernels.Q8_0, raw, None, 4, 64, 0, 3, out, 0)  # short out
    with pytest.raises(ValueError):
        _ckernels.dequantize(ckernels.Q8_0, raw, None, 4, 64, 3, 5, out, 0)  # rows past m
    with pytest.raises(ValueError):
        _ckernels.dequantize(ckernels.LOOM_Q4, raw, None, 4, 64, 0, 2, out, 0)  # no scales

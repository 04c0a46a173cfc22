"""poly.quant.qtensor: blocked matmul, row-range dequantize, the Loom Q4_0 bake and GGUF quant blocks."""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from poly.dtypes import DType
from poly.errors import EntityFormatError, GGUFFormatError, LayerConfigError, UnsupportedError
from poly.quant import qtensor
from poly.quant.qtensor import (
    CodedMatrix,
    DenseMatrix,
    GGUFMatrix,
    Q4Matrix,
    QTensor,
    as_qtensor,
    encode_matrix,
)

Q = GGMLQuantizationType


def _w(out: int = 70, n_in: int = 45, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((out, n_in)).astype(np.float32)


def _x(n: int, n_in: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, n_in)).astype(np.float32)


def _gguf(w: np.ndarray, qtype: Q) -> GGUFMatrix:
    raw = np.asarray(gq.quantize(w, qtype))
    return GGUFMatrix(raw.view(np.uint8).reshape(-1), int(qtype), w.shape)


def _all_matrices(w: np.ndarray) -> dict[str, QTensor]:
    mats = {
        "dense_f32": DenseMatrix(w),
        "dense_f16": DenseMatrix(w.astype(np.float16)),
        "dense_bf16": DenseMatrix(w.astype(ml_dtypes.bfloat16)),
        "loom_q4": Q4Matrix.quantize(w),
    }
    mats |= {f"coded_{dt}": CodedMatrix.encode(w, dt) for dt in DType}
    if w.shape[1] % 32 == 0:
        mats |= {f"gguf_{t.name}": _gguf(w, t) for t in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.F32)}
    return mats


@pytest.mark.parametrize("shape", [(70, 45), (48, 64), (5, 96)])
def test_matmul_equals_dequantized_product(shape):
    w = _w(*shape)
    x = _x(4, shape[1])
    for name, m in _all_matrices(w).items():
        m.block_rows = 16  # several blocks, the last one partial
        ref = x.astype(np.float64) @ m.dequantize().astype(np.float64).T
        got = m.matmul(x)
        assert got.dtype == np.float32 and got.shape == (4, shape[0]), name
        tol = 1e-5 * np.abs(x).sum(axis=1, keepdims=True) * np.abs(m.dequantize()).max()
        assert (np.abs(got - ref) <= tol + 1e-30).all(), name
        vec = m.matmul(x[2])
        assert vec.shape == (shape[0],), name
        np.testing.assert_allclose(vec, got[2], rtol=1e-5, atol=float(tol.max()))


# Elementwise bound on |W_q - W| relative to the row's max|w| (docs/dtypes.md), Q4 per block.
ELEMENT_BOUND = {"coded_int8": 1 / 254, "coded_int4": 1 / 14, "coded_fp8e4m3": 1 / 28,
                 "dense_f16": 2**-11, "dense_bf16": 2**-8, "loom_q4": 1 / 14,
                 "coded_uint8": 1 / 255, "coded_fp4": 1 / 6, "dense_f32": 0.0}  # fmt: skip


def test_matmul_error_against_float32_original():
    w = _w(48, 64)
    x = _x(3, 64)
    exact = x.astype(np.float64) @ w.astype(np.float64).T  # [3, 48]
    mats = _all_matrices(w)
    rowmax = np.abs(w).max(axis=1).astype(np.float64)  # [48]
    for name, bound in ELEMENT_BOUND.items():
        # |x @ (Wq - W).T| <= sum|x| * bound * max|w_row|; Q4 blocks never span rows here (64 % 32 == 0)
        # plus float32 accumulation error (1e-6 relative), so float32 itself has a non-zero limit
        scale = np.abs(x).sum(axis=1, keepdims=True) * rowmax[None, :]  # [3, 48]
        err = np.abs(mats[name].matmul(x) - exact)
        assert (err <= scale * (bound * (1 + 1e-5) + 1e-6)).all(), name


def test_row_range_dequantize_equals_slice_of_full():
    w = _w(70, 45)
    for name, m in _all_matrices(w).items():
        full = m.dequantize()
        assert full.shape == w.shape and full.dtype == np.float32, name
        for a, b in [(0, 1), (5, 33), (69, 70), (10, 10), (0, 70)]:
            np.testing.assert_array_equal(m.dequantize(a, b), full[a:b], err_msg=name)
        with pytest.raises(LayerConfigError):
            m.dequantize(3, 71)


def test_shape_and_out_checks():
    m = Q4Matrix.quantize(_w(8, 32))
    with pytest.raises(LayerConfigError):
        m.matmul(np.zeros((2, 31), np.float32))
    out = np.empty((2, 8), np.float32)
    x = _x(2, 32)
    assert m.matmul(x, out=out) is out
    np.testing.assert_array_equal(out, m.matmul(x))
    with pytest.raises(LayerConfigError):
        m.matmul(x, out=np.empty((2, 7), np.float32))
    with pytest.raises(LayerConfigError):
        DenseMatrix(np.zeros((3, 3), np.int8))


def test_dense_and_q4_keep_memmap_views(tmp_path):
    w = _w(16, 64)
    path = tmp_path / "w.bin"
    w.tofile(path)
    mm = np.memmap(path, dtype=np.float32, mode="r", shape=w.shape)
    dense = as_qtensor(mm)
    assert isinstance(dense, DenseMatrix) and np.shares_memory(dense.array, mm)
    assert as_qtensor(dense) is dense
    payload = tmp_path / "q4.bin"
    payload.write_bytes(Q4Matrix.quantize(w).to_loom_payload())
    buf = np.memmap(payload, dtype=np.uint8, mode="r")
    q4 = Q4Matrix.from_loom_payload(buf, w.shape)
    assert np.shares_memory(q4.packed, buf) and np.shares_memory(q4.scales, buf)


# --- the Q4_0 bake, re-implemented with Python scalars (inventory §2.5, Appendix A) ----------


def _q4_reference(w: np.ndarray) -> tuple[list[np.float32], list[int]]:
    flat = [np.float32(v) for v in w.reshape(-1)]
    flat += [np.float32(0)] * (-len(flat) % 32)
    scales, data = [], []
    for b in range(0, len(flat), 32):
        block = flat[b : b + 32]
        scale = np.float32(max(abs(v) for v in block) / np.float32(7))
        codes = []
        for v in block:
            if scale == 0:
                codes.append(0)
                continue
            x = float(np.float32(v / scale))  # divided in float32
            q = int(math.copysign(math.floor(abs(x) + 0.5), x))  # Go math.Round: half away
            codes.append(min(7, max(-8, q)))
        scales.append(scale)
        data += [(codes[2 * k] & 0xF) | ((codes[2 * k + 1] & 0xF) << 4) for k in range(16)]
    return scales, data


def test_q4_bake_matches_python_reference():
    w = _w(7, 45)  # 315 weights: blocks span rows, last block partial
    w[0, :32] = 0.0  # an all-zero block
    w[1, 5:12] = [7.0, 2.5, -2.5, 0.5, -0.5, -3.5, 6.5]  # ties: half away from zero, not to even
    scales, data = _q4_reference(w)
    q = Q4Matrix.quantize(w)
    assert q.scales.dtype == np.float32 and q.packed.shape == (len(scales), 16)
    np.testing.assert_array_equal(q.scales, np.array(scales, np.float32))
    assert q.packed.reshape(-1).tolist() == data
    codes = [((b & 0xF) ^ 8) - 8 for b in data for b in (b, b >> 4)]
    deq = [c * float(scales[i // 32]) for i, c in enumerate(codes)][: w.size]
    np.testing.assert_allclose(q.dequantize().reshape(-1), np.float32(deq), rtol=0, atol=0)


def test_q4_payload_layout_and_round_trip():
    w = _w(24, 64)
    q = Q4Matrix.quantize(w)
    nb = w.size // 32
    payload = q.to_loom_payload()
    n_words = max(512, -(-4 * nb // 64) * 64)
    assert len(payload) == 8 + 4 * nb + 4 * n_words
    assert struct.unpack("<II", payload[:8]) == (nb, n_words)
    assert struct.unpack(f"<{nb}f", payload[8 : 8 + 4 * nb]) == tuple(float(s) for s in q.scales)
    words = np.frombuffer(payload[8 + 4 * nb :], "<u4")
    p = q.packed.astype(np.uint32)
    assert words[1] == p[0, 4] | p[0, 5] << 8 | p[0, 6] << 16 | p[0, 7] << 24  # byte 4j in bits 0-7
    assert (words[4 * nb :] == 0).all()
    back = Q4Matrix.from_loom_payload(payload, w.shape)
    np.testing.assert_array_equal(back.dequantize(), q.dequantize())


@pytest.mark.parametrize("cut", ["short", "scales", "words", "extra", "nan"])
def test_q4_payload_errors(cut):
    w = _w(4, 64)
    good = bytearray(Q4Matrix.quantize(w).to_loom_payload())
    bad = {
        "short": good[:6],
        "scales": struct.pack("<I", 9) + good[4:],
        "words": good[:4] + struct.pack("<I", 3) + good[8:],
        "extra": good + b"\0\0\0\0",
        "nan": good[:8] + struct.pack("<f", float("nan")) + good[12:],
    }[cut]
    with pytest.raises(EntityFormatError):
        Q4Matrix.from_loom_payload(bytes(bad), w.shape)


# --- GGUF blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F16, Q.F32])
def test_gguf_matrix_equals_gguf_dequantize(qtype):
    w = _w(40, 128)
    raw = np.asarray(gq.quantize(w, qtype))
    ref = gq.dequantize(raw, qtype)  # the package's own whole-tensor decode
    m = GGUFMatrix(raw.view(np.uint8).reshape(-1), int(qtype), w.shape)
    m.block_rows = 16
    np.testing.assert_array_equal(m.dequantize(), ref)
    np.testing.assert_array_equal(m.dequantize(7, 29), ref[7:29])
    x = _x(2, 128)
    np.testing.assert_allclose(m.matmul(x), x @ ref.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_gguf_k_quant_row_ranges(qtype):
    # gguf cannot quantize K types; random block bytes still decode, so check slicing against it.
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(5).integers(0, 256, (6, 2 * size), dtype=np.uint8)
    ref = gq.dequantize(raw, qtype)  # [6, 2 * block]
    m = GGUFMatrix(raw.reshape(-1), int(qtype), (6, 2 * block))
    assert m.scheme == "gguf_" + qtype.name.lower()
    np.testing.assert_array_equal(m.dequantize(2, 5), ref[2:5])
    np.testing.assert_array_equal(m.dequantize(), ref)


def test_gguf_matrix_errors():
    raw = np.zeros(34 * 4, np.uint8)
    with pytest.raises(GGUFFormatError):
        GGUFMatrix(raw, 9999, (4, 32))
    with pytest.raises(UnsupportedError):
        GGUFMatrix(raw, int(Q.I8), (4, 32))
    with pytest.raises(GGUFFormatError):
        GGUFMatrix(raw, int(Q.Q8_0), (4, 33))  # row not a whole number of blocks
    with pytest.raises(GGUFFormatError):
        GGUFMatrix(raw[:-1], int(Q.Q8_0), (4, 32))


@pytest.mark.real_model
def test_gguf_matrix_on_real_smollm2_tensors(smollm2_gguf):
    from gguf import GGUFReader  # test-only: a trusted file we downloaded ourselves

    reader = GGUFReader(str(smollm2_gguf))
    wanted = {"blk.0.attn_k.weight", "blk.0.ffn_down.weight", "token_embd.weight"}
    seen = 0
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        ne = [int(d) for d in t.shape]  # GGUF dims, fastest first
        shape = (ne[1], ne[0])
        m = GGUFMatrix(t.data, int(t.tensor_type), shape)
        rows = slice(3, 11)
        ref = gq.dequantize(np.asarray(t.data)[rows], t.tensor_type)
        np.testing.assert_array_equal(m.dequantize(rows.start, rows.stop), ref)
        seen += 1
    assert seen == len(wanted)


# --- helpers and the kernel hook ---------------------------------------------------------------


def test_encode_matrix_kinds():
    w = _w(8, 64)
    assert isinstance(encode_matrix(w, "float32"), DenseMatrix)
    assert encode_matrix(w, "bf16").scheme == "bfloat16"
    assert encode_matrix(w, "loom_q4").scheme == "loom_q4"
    assert encode_matrix(w, "q4_0").scheme == "loom_q4"  # the old name of the Loom bake
    m = encode_matrix(w, DType.INT8)
    assert isinstance(m, CodedMatrix) and m.scheme == "int8"
    assert m.nbytes == w.size + 4 * w.shape[0]  # int8 codes + one float32 scale per row


def test_registered_kernel_is_used(monkeypatch):
    m = CodedMatrix.encode(_w(8, 16), DType.INT8)
    calls = []

    def kernel(qt, x2, out):
        calls.append(x2.shape)
        out[:] = x2 @ qt.dequantize().T

    monkeypatch.setitem(qtensor.KERNELS, "int8", kernel)
    x = _x(3, 16)
    np.testing.assert_array_equal(m.matmul(x), x @ m.dequantize().T)
    assert calls == [(3, 16)]


def test_gguf_f32_prefill_is_one_blas_call_on_the_stored_rows():
    """A GGUF F32 tensor multiplies straight from its stored rows (numpy's own x @ W.T, bit for
    bit) for any row count; it was copied tile by tile through the dequantizer before."""
    from poly.quant.ggml import GGMLType
    from poly.quant.qtensor import GGUFMatrix

    rng = np.random.default_rng(7)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    g = GGUFMatrix(w.view(np.uint8).reshape(-1), GGMLType.F32, w.shape)
    for n in (1, 5, 42):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        want = x @ w.T
        np.testing.assert_allclose(g.matmul(x), want, rtol=1e-6, atol=1e-5)
        res = np.empty((n, 96), np.float32)
        g.matmul_reference(x, res)
        np.testing.assert_array_equal(res, want)

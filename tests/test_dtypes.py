"""poly.dtypes: ids, names, codecs (against ml_dtypes and plain numpy formulas), packing, Loom decode."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from poly.dtypes import (
    DType,
    decode,
    decode_rows,
    encode,
    encode_vector,
    loom_nbytes,
    parse_dtype,
)
from poly.errors import DTypeError, EntityFormatError, NumericalError
from poly.quant.loom_v1 import loom_decode

D = DType

# Loom's table (inventory §2.1): id -> (name, bits).
LOOM_TABLE = {
    0: ("float64", 64), 1: ("float32", 32), 2: ("float16", 16), 3: ("bfloat16", 16),
    4: ("fp8e4m3", 8), 5: ("fp8e5m2", 8), 6: ("int64", 64), 7: ("int32", 32), 8: ("int16", 16),
    9: ("int8", 8), 10: ("uint64", 64), 11: ("uint32", 32), 12: ("uint16", 16), 13: ("uint8", 8),
    14: ("int4", 4), 15: ("uint4", 4), 16: ("fp4", 4), 17: ("int2", 2), 18: ("uint2", 2),
    19: ("ternary", 2), 20: ("binary", 1),
}  # fmt: skip

# ParseDType aliases (inventory §2.1).
LOOM_ALIASES = {
    "FLOAT64": 0, "FP64": 0, "F64": 0, "FLOAT32": 1, "FP32": 1, "F32": 1, "FLOAT16": 2,
    "FP16": 2, "F16": 2, "BFLOAT16": 3, "BF16": 3, "FP8E4M3": 4, "FP8": 4, "FP8E5M2": 5,
    "INT64": 6, "I64": 6, "INT32": 7, "I32": 7, "INT16": 8, "I16": 8, "INT8": 9, "I8": 9,
    "UINT64": 10, "U64": 10, "UINT32": 11, "U32": 11, "UINT16": 12, "U16": 12, "UINT8": 13,
    "U8": 13, "INT4": 14, "UINT4": 15, "FP4": 16, "F4": 16, "INT2": 17, "UINT2": 18,
    "TERNARY": 19, "BINARY": 20,
}  # fmt: skip

# The documented error bound of each codec (docs/dtypes.md), relative to the row's max|w|.
BOUNDS = {
    D.FLOAT64: 0.0, D.FLOAT32: 0.0, D.FLOAT16: 2**-11, D.BFLOAT16: 2**-8,
    D.FP8E4M3: 1 / 28, D.FP8E5M2: 1 / 14, D.FP4: 1 / 6,
    D.INT64: 2**-23, D.INT32: 2**-23, D.INT16: 1 / 65534, D.INT8: 1 / 254, D.INT4: 1 / 14,
    D.INT2: 1 / 2, D.TERNARY: 1 / 2, D.BINARY: 1.0,
    D.UINT64: 2**-23, D.UINT32: 2**-23, D.UINT16: 1 / 65535, D.UINT8: 1 / 255,
    D.UINT4: 1 / 15, D.UINT2: 1 / 3,
}  # fmt: skip

FLOAT_FORMATS = {
    D.FP8E4M3: (ml_dtypes.float8_e4m3fn, 448.0),
    D.FP8E5M2: (ml_dtypes.float8_e5m2, 57344.0),
    D.FP4: (ml_dtypes.float4_e2m1fn, 6.0),
}


def test_ids_names_bits_match_loom():
    assert len(DType) == 21
    for i, (name, bits) in LOOM_TABLE.items():
        dt = DType(i)
        assert (dt.label, str(dt), f"{dt}", dt.bits) == (name, name, name, bits)
        assert dt.is_sub_byte == (bits < 8)
    assert D.FP4.is_float and D.FP8E5M2.is_float and not D.INT8.is_float
    assert D.INT4.is_signed and D.TERNARY.is_signed and not D.UINT2.is_signed


def test_tile_bytes_follow_loom():
    wide = {D.FLOAT64: 8, D.INT64: 8, D.UINT64: 8, D.FLOAT32: 4, D.FLOAT16: 4, D.BFLOAT16: 4}
    wide |= {D.INT32: 4, D.UINT32: 4, D.INT16: 2, D.UINT16: 2}
    for dt in DType:
        assert dt.tile_bytes == wide.get(dt, 1), dt


@pytest.mark.parametrize("alias,dt_id", sorted(LOOM_ALIASES.items()))
def test_parse_dtype_aliases_case_insensitive(alias, dt_id):
    for text in (alias, alias.lower(), alias.title(), f" {alias} "):
        assert parse_dtype(text) is DType(dt_id)
    assert parse_dtype(dt_id) is DType(dt_id) and parse_dtype(DType(dt_id)) is DType(dt_id)


@pytest.mark.parametrize("bad", ["Q4_0", "", "float128", "int3", 21, -1, 3.0, None, True, b"f32"])
def test_parse_dtype_unknown_is_an_error(bad):
    with pytest.raises(DTypeError):
        parse_dtype(bad)


def _test_matrix(n: int = 37) -> np.ndarray:
    """Rows of mixed magnitude plus the edge cases: all-zero, constant, ±extremes, a single spike."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((12, n)).astype(np.float32)
    w *= np.logspace(-3, 3, 12, dtype=np.float32)[:, None]  # row magnitudes 1e-3 .. 1e3
    w[1] = 0.0
    w[2] = 0.75  # constant row
    w[3, min(5, n - 1)] = -50.0  # negative extreme sets max|w|
    w[4, 0], w[4, -1] = 40.0, -40.0  # both extremes
    w[5] = 0.0
    w[5, n // 2] = 3.0  # single spike
    w[6] = np.abs(w[6])  # all positive
    w[7] = -np.abs(w[7])  # all negative
    return w


@pytest.mark.parametrize("dt", list(DType), ids=str)
@pytest.mark.parametrize("n", [37, 64, 3])
def test_round_trip_within_documented_bound(dt, n):
    w = _test_matrix(n)
    enc = encode(w, dt)
    out = decode(enc)
    assert out.dtype == np.float32 and out.shape == w.shape
    assert np.isfinite(out).all()
    m = np.abs(w).max(axis=1, keepdims=True)
    slack = 2.0**-23 * m
    assert (np.abs(out - w) <= BOUNDS[dt] * m * (1 + 1e-6) + slack).all()
    assert (out[1] == 0).all()  # all-zero row stays zero (no NaN from a zero scale)


@pytest.mark.parametrize("dt", [D.FLOAT32, D.FLOAT64])
def test_wide_floats_are_exact(dt):
    w = _test_matrix()
    assert np.array_equal(decode(encode(w, dt)), w)


@pytest.mark.parametrize("dt,ref", [(D.FLOAT16, np.float16), (D.BFLOAT16, ml_dtypes.bfloat16)])
def test_half_types_equal_ml_dtypes_cast(dt, ref):
    w = _test_matrix()
    w[0, :3] = [1e5, -1e-9, 65519.0]  # f16 overflow / subnormal / rounding edge
    with np.errstate(over="ignore"):
        expect = w.astype(ref).astype(np.float32)
    np.testing.assert_array_equal(decode(encode(w, dt)), expect)
    assert encode(w, dt).scales is None


@pytest.mark.parametrize("dt", list(FLOAT_FORMATS), ids=str)
def test_scaled_floats_equal_ml_dtypes_cast(dt):
    fmt, fmax = FLOAT_FORMATS[dt]
    w = _test_matrix()
    enc = encode(w, dt)
    for r, row in enumerate(w):
        scale = np.float32(float(np.abs(row).max()) / fmax)
        if scale == 0:
            expect = np.zeros_like(row)
        else:
            x = np.clip(row / scale, -fmax, fmax)
            expect = x.astype(fmt).astype(np.float32) * scale
        assert enc.scales[r] == scale
        np.testing.assert_array_equal(decode_rows(enc, r, r + 1)[0], expect)


def _grid_rows(qlo: int, qhi: int, n: int = 29) -> np.ndarray:
    """Rows of integers k/8 in [qlo, qhi] that hit both ends: exactly representable codes."""
    rng = np.random.default_rng(3)
    k = rng.integers(qlo, qhi + 1, size=(5, n))
    k[:, 0], k[:, 1] = qlo, qhi
    return (k / 8.0).astype(np.float32)


@pytest.mark.parametrize(
    "dt,qlo,qhi",
    [(D.INT8, -127, 127), (D.INT16, -32767, 32767), (D.INT4, -7, 7), (D.INT2, -1, 1),
     (D.TERNARY, -1, 1), (D.UINT8, -100, 155), (D.UINT16, 0, 65535), (D.UINT4, -8, 7),
     (D.UINT2, 1, 4)],
    ids=str,
)  # fmt: skip
def test_integer_codes_in_range_are_exact(dt, qlo, qhi):
    w = _grid_rows(qlo, qhi)
    np.testing.assert_array_equal(decode(encode(w, dt)), w)


def test_symmetric_kinds_match_numpy_formula():
    w = _test_matrix()
    m = np.abs(w).max(axis=1, keepdims=True).astype(np.float64)
    for dt, qmax in [(D.INT8, 127), (D.INT4, 7), (D.INT2, 1), (D.TERNARY, 1)]:
        s = m / qmax
        expect = np.clip(np.rint(w / np.where(s > 0, s, 1)), -qmax, qmax) * s
        np.testing.assert_allclose(decode(encode(w, dt)), expect, rtol=1e-6, atol=1e-30)


def test_binary_is_sign_times_mean_abs():
    w = _test_matrix()
    mean = np.abs(w.astype(np.float64)).mean(axis=1, keepdims=True)
    expect = np.where(w >= 0, mean, -mean)
    np.testing.assert_allclose(decode(encode(w, D.BINARY)), expect, rtol=1e-6)


def test_each_dtype_gets_its_own_fresh_scale():
    # Loom defect §10.2 #19: one shared scale across dtypes clips int4 after an int8 morph.
    w = _test_matrix()
    m = np.abs(w).max(axis=1)
    s8, s4 = encode(w, D.INT8).scales, encode(w, D.INT4).scales
    np.testing.assert_allclose(s8, m / 127, rtol=1e-6)
    np.testing.assert_allclose(s4, m / 7, rtol=1e-6)


def _pack_reference(codes, bits: int) -> list[int]:
    """inventory §4.4 with Python ints: element 0 in the highest bits of byte 0."""
    per, mask = 8 // bits, (1 << bits) - 1
    out = [0] * (-(-len(codes) // per))
    for i, c in enumerate(codes):
        out[i // per] |= (int(c) & mask) << (8 - bits * (i % per + 1))
    return out


@pytest.mark.parametrize("dt", [dt for dt in DType if dt.is_sub_byte], ids=str)
def test_sub_byte_packing_layout(dt):
    w = _test_matrix(n=13)
    enc = encode(w, dt)
    assert enc.codes.dtype == np.uint8 and enc.codes.shape == (12, loom_nbytes(dt, 13))
    for r, row in enumerate(w):
        if dt is D.FP4:
            scale = enc.scales[r] if enc.scales[r] > 0 else np.float32(1)
            codes = (row / scale).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        elif dt is D.BINARY:
            codes = (row >= 0).astype(int)
        elif dt.is_signed:
            codes = np.rint(row / max(float(enc.scales[r]), 1e-30)).astype(int)
        else:
            s = float(enc.scales[r]) or 1.0
            codes = np.rint((row.astype(np.float64) - float(enc.zero[r])) / s).astype(int)
        assert list(enc.codes[r]) == _pack_reference(codes, dt.bits), r


def test_one_dimensional_data():
    v = _test_matrix()[3]
    enc = encode(v, D.INT4)
    assert enc.shape == v.shape and enc.codes.shape == (loom_nbytes(D.INT4, v.size),)
    assert enc.scales.shape == (1,)
    np.testing.assert_array_equal(decode(enc), decode(encode(v[None], D.INT4))[0])
    np.testing.assert_array_equal(decode(encode_vector(v, "int4")), decode(enc))
    with pytest.raises(DTypeError):
        encode_vector(v[None], D.INT4)


def test_bad_inputs():
    with pytest.raises(NumericalError):
        encode(np.array([1.0, np.nan], np.float32), D.INT8)
    with pytest.raises(DTypeError):
        encode(np.zeros((2, 2, 2), np.float32), D.INT8)
    with pytest.raises(DTypeError):
        decode_rows(encode(np.zeros((3, 4), np.float32), D.INT8), 2, 5)
    assert np.isinf(decode(encode(np.array([np.inf], np.float32), D.FLOAT16))).all()


# --- Loom v1 blobs: bytes built by hand from inventory §4.4, values from §2.2/§2.3 -----------


@pytest.mark.parametrize(
    "dt,fmt", [(D.FLOAT64, "<d"), (D.INT64, "<q"), (D.INT32, "<i"), (D.INT16, "<h"),
               (D.INT8, "<b"), (D.UINT64, "<Q"), (D.UINT32, "<I"), (D.UINT16, "<H"),
               (D.UINT8, "<B")], ids=str,
)  # fmt: skip
def test_loom_decode_byte_kinds(dt, fmt):
    vals = [0, 1, 5, 100, 127] if dt.label.startswith("u") else [0, -1, 5, -100, 127]
    raw = b"".join(struct.pack(fmt, v) for v in vals)
    scale = 1.0 if dt is D.FLOAT64 else 0.25  # float64 ignores the scale
    expect = np.array(vals, np.float32) * np.float32(scale if dt is not D.FLOAT64 else 1.0)
    np.testing.assert_array_equal(loom_decode(raw, dt, len(vals), 0.25), expect)


def test_loom_decode_float_kinds():
    vals = [0.0, 1.5, -2.25, 3.0e-5, 65504.0]
    raw32 = struct.pack("<5f", *vals)
    np.testing.assert_array_equal(loom_decode(raw32, D.FLOAT32, 5, 9.0), np.float32(vals))
    raw16 = np.array(vals, np.float16).tobytes()
    np.testing.assert_array_equal(loom_decode(raw16, "f16", 5), np.float32(np.float16(vals)))
    top16 = b"".join(struct.pack("<f", v)[2:] for v in vals)  # bf16 = top 16 bits
    expect = [struct.unpack("<f", b"\0\0" + top16[2 * i : 2 * i + 2])[0] for i in range(5)]
    np.testing.assert_array_equal(loom_decode(top16, "bf16", 5, 3.0), np.float32(expect))


def test_loom_decode_fp8():
    # E4M3 bias 7: 0x38 = 1.0, 0x7F = 480 (no NaN code), 0x01 = 2^-9, 0xC4 = -3.0
    got = loom_decode(bytes([0x38, 0x7F, 0x01, 0xC4]), D.FP8E4M3, 4, 2.0)
    np.testing.assert_array_equal(got, np.float32([2.0, 960.0, 2.0**-8, -6.0]))
    codes = np.array([0x3C, 0x7B, 0x84], np.uint8)  # E5M2: 1.0, 57344, -2^-16
    expect = codes.view(ml_dtypes.float8_e5m2).astype(np.float32) * 0.5
    np.testing.assert_array_equal(loom_decode(codes.tobytes(), D.FP8E5M2, 3, 0.5), expect)


def test_loom_decode_sub_byte_kinds():
    # int4: high nibble first, two's complement: 0x7F -> 7, -1; 0x8_ -> -8 (3 elements, padded)
    np.testing.assert_array_equal(loom_decode(bytes([0x7F, 0x80]), D.INT4, 3, 0.5), [3.5, -0.5, -4])
    np.testing.assert_array_equal(loom_decode(bytes([0x7F]), D.UINT4, 2, 1.0), [7, 15])
    # 2-bit: bits 7-6 first; 0b11_10_01_00 -> int2 -1,-2,1,0 / uint2 3,2,1,0
    np.testing.assert_array_equal(loom_decode(bytes([0xE4]), D.INT2, 4, 2.0), [-2, -4, 2, 0])
    np.testing.assert_array_equal(loom_decode(bytes([0xE4]), D.UINT2, 4, 2.0), [6, 4, 2, 0])
    np.testing.assert_array_equal(loom_decode(bytes([0xC4]), D.TERNARY, 3, 1.0), [-1, 0, 1])
    # binary: MSB first, 1 = +1, 0 = -1
    want = [1, -1, 1, 1, -1, -1, -1, -1, 1]
    np.testing.assert_array_equal(loom_decode(bytes([0xB0, 0x80]), D.BINARY, 9, 1.0), want)
    # fp4: Loom's private table (not OCP E2M1): 0x1 = 0.75, 0x5 = 3, 0xD = -3, 0x9 = -0.75
    np.testing.assert_array_equal(
        loom_decode(bytes([0x15, 0xD9]), D.FP4, 4, 2.0), np.float32([1.5, 6, -6, -1.5])
    )


def test_loom_decode_missing_scale_is_one_and_sizes_are_checked():
    np.testing.assert_array_equal(loom_decode(bytes([0x7F]), D.INT8, 1, None), [127])
    np.testing.assert_array_equal(loom_decode(bytes([0x7F]), D.INT8, 1, 0.0), [127])
    with pytest.raises(EntityFormatError):
        loom_decode(bytes(3), D.INT4, 3, 1.0)  # needs 2 bytes
    with pytest.raises(EntityFormatError):
        loom_decode(bytes(7), D.FLOAT32, 2, 1.0)
    with pytest.raises(DTypeError):
        loom_decode(bytes(4), "q4_0", 4, 1.0)

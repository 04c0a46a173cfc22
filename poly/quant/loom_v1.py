"""Loom v1 native blobs (inventory §4.4 packing, §2.3 rules) decoded to float32."""

from __future__ import annotations

import numpy as np

from poly.dtypes import DType, loom_nbytes, parse_dtype, unpack_codes
from poly.errors import EntityFormatError

D = DType

_LOOM_FP4 = np.array(
    [0, 0.75, 1, 1.5, 2, 3, np.inf, np.nan, -0.0, -0.75, -1, -1.5, -2, -3, -np.inf, np.nan],
    dtype=np.float32,
)


def _loom_e4m3_table() -> np.ndarray:
    # Bias 7, no NaN code: S.1111.111 decodes as 480 (Loom saturates there).
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    mag = np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    return (sign * mag).astype(np.float32)


_LOOM_E4M3 = _loom_e4m3_table()

# Byte-per-element Loom encodings: little-endian numpy dtype of the raw codes.
_LOOM_WIDE: dict[DType, str] = {
    D.FLOAT64: "<f8", D.FLOAT32: "<f4", D.FLOAT16: "<f2", D.BFLOAT16: "<u2",
    D.INT64: "<i8", D.INT32: "<i4", D.INT16: "<i2", D.INT8: "i1",
    D.UINT64: "<u8", D.UINT32: "<u4", D.UINT16: "<u2", D.UINT8: "u1",
    D.FP8E4M3: "u1", D.FP8E5M2: "u1",
}  # fmt: skip
_LOOM_UNSCALED = {D.FLOAT64, D.FLOAT32, D.FLOAT16, D.BFLOAT16}


def _loom_values(raw: np.ndarray, dt: DType, count: int) -> np.ndarray:
    if dt.is_sub_byte:
        signed = dt in (D.INT4, D.INT2, D.TERNARY)
        c = unpack_codes(raw[None], dt.bits, count, signed)[0]
        if dt is D.FP4:
            return _LOOM_FP4[c]
        if dt is D.BINARY:
            return np.where(c == 1, 1.0, -1.0).astype(np.float32)
        return c.astype(np.float32)
    codes = raw.view(_LOOM_WIDE[dt])
    if dt is D.FP8E4M3:
        return _LOOM_E4M3[codes]
    if dt is D.FP8E5M2:
        import ml_dtypes

        return codes.view(ml_dtypes.float8_e5m2).astype(np.float32)
    if dt is D.BFLOAT16:
        return (codes.astype(np.uint32) << 16).view(np.float32)
    return codes.astype(np.float32)


def loom_decode(
    raw, dtype: DType | int | str, count: int, scale: float | None = None
) -> np.ndarray:
    """Decode a Loom v1 native blob (§4.4 packing, §2.3 rules) to float32 [count].

    One per-layer `scale` multiplies every kind except float64/32/16 and bfloat16; a missing or zero
    scale counts as 1.0. The byte length must be exactly `loom_nbytes(dtype, count)`.
    """
    dt = parse_dtype(dtype)
    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    buf = buf.reshape(-1).view(np.uint8)
    if count < 0 or buf.size != loom_nbytes(dt, count):
        raise EntityFormatError(
            f"{dt} blob of {count} elements needs {loom_nbytes(dt, max(count, 0))} bytes, "
            f"got {buf.size} (size_mismatch)"
        )
    values = _loom_values(buf, dt, count)
    if dt in _LOOM_UNSCALED or not scale:
        return values.astype(np.float32, copy=False)
    return (values * np.float32(scale)).astype(np.float32, copy=False)

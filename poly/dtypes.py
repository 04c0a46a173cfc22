"""The 21 Loom dtypes: ids, names, aliases and standard codecs.

Codecs are standard (ml_dtypes round-to-nearest-even, OCP fp8/fp4) and every 2-D encoding gets its
own per-row scale, computed fresh for that dtype. `loom_decode` reads Loom v1 blobs bit-exactly.
See docs/dtypes.md for the table of schemes and error bounds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from poly.errors import DTypeError, NumericalError


class DType(IntEnum):
    FLOAT64 = 0
    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FP8E4M3 = 4
    FP8E5M2 = 5
    INT64 = 6
    INT32 = 7
    INT16 = 8
    INT8 = 9
    UINT64 = 10
    UINT32 = 11
    UINT16 = 12
    UINT8 = 13
    INT4 = 14
    UINT4 = 15
    FP4 = 16
    INT2 = 17
    UINT2 = 18
    TERNARY = 19
    BINARY = 20

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def bits(self) -> int:
        return _INFO[self].bits

    @property
    def is_float(self) -> bool:
        return _INFO[self].is_float

    @property
    def is_signed(self) -> bool:
        return _INFO[self].is_signed

    @property
    def is_sub_byte(self) -> bool:
        return self.bits < 8

    @property
    def tile_bytes(self) -> int:
        """Bytes per element in Loom's tile formulas (f16/bf16 count as 4: Loom keeps them as f32)."""
        return _INFO[self].tile_bytes

    def __str__(self) -> str:
        return self.label

    def __format__(self, spec: str) -> str:
        return format(self.label, spec)


class _Info(NamedTuple):
    bits: int
    is_float: bool
    is_signed: bool
    tile_bytes: int


D = DType
_INFO: dict[DType, _Info] = {
    D.FLOAT64: _Info(64, True, True, 8),
    D.FLOAT32: _Info(32, True, True, 4),
    D.FLOAT16: _Info(16, True, True, 4),
    D.BFLOAT16: _Info(16, True, True, 4),
    D.FP8E4M3: _Info(8, True, True, 1),
    D.FP8E5M2: _Info(8, True, True, 1),
    D.INT64: _Info(64, False, True, 8),
    D.INT32: _Info(32, False, True, 4),
    D.INT16: _Info(16, False, True, 2),
    D.INT8: _Info(8, False, True, 1),
    D.UINT64: _Info(64, False, False, 8),
    D.UINT32: _Info(32, False, False, 4),
    D.UINT16: _Info(16, False, False, 2),
    D.UINT8: _Info(8, False, False, 1),
    D.INT4: _Info(4, False, True, 1),
    D.UINT4: _Info(4, False, False, 1),
    D.FP4: _Info(4, True, True, 1),
    D.INT2: _Info(2, False, True, 1),
    D.UINT2: _Info(2, False, False, 1),
    D.TERNARY: _Info(2, False, True, 1),
    D.BINARY: _Info(1, False, True, 1),
}

# Loom's ParseDType aliases (inventory §2.1); the lower-case names themselves are added below.
_ALIASES: dict[str, DType] = {
    "fp64": D.FLOAT64, "f64": D.FLOAT64,
    "fp32": D.FLOAT32, "f32": D.FLOAT32,
    "fp16": D.FLOAT16, "f16": D.FLOAT16,
    "bf16": D.BFLOAT16,
    "fp8": D.FP8E4M3,
    "i64": D.INT64, "i32": D.INT32, "i16": D.INT16, "i8": D.INT8,
    "u64": D.UINT64, "u32": D.UINT32, "u16": D.UINT16, "u8": D.UINT8,
    "f4": D.FP4,
}  # fmt: skip
_ALIASES.update({dt.label: dt for dt in DType})


def parse_dtype(x: DType | int | str) -> DType:
    """A DType from a DType, an int id or a name/alias (case-insensitive). Unknown -> DTypeError."""
    if isinstance(x, DType):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        if 0 <= int(x) <= 20:
            return DType(int(x))
        raise DTypeError(f"unknown dtype id {int(x)} (valid ids are 0..20)")
    if isinstance(x, str):
        dt = _ALIASES.get(x.strip().lower())
        if dt is not None:
            return dt
        raise DTypeError(f"unknown dtype name {x!r}")
    raise DTypeError(f"cannot interpret {type(x).__name__} as a dtype")


# --- codecs -----------------------------------------------------------------------------------


class _Codec(NamedTuple):
    kind: str  # "cast" | "float" (scaled float) | "sym" | "affine" | "sign"
    store: type | None  # numpy / ml_dtypes type of the unpacked codes
    qmax: float = 0.0  # largest code magnitude, or the float format's max finite value


def _codec(dt: DType) -> _Codec:
    got = _CODECS.get(dt)
    return got if got is not None else _ml_codecs()[dt]


@functools.cache
def _ml_codecs() -> dict[DType, _Codec]:
    import ml_dtypes  # imported when first used: ~0.2-0.8 s of every process's start otherwise

    return {
        D.BFLOAT16: _Codec("cast", ml_dtypes.bfloat16),
        D.FP8E4M3: _Codec("float", ml_dtypes.float8_e4m3fn, 448.0),
        D.FP8E5M2: _Codec("float", ml_dtypes.float8_e5m2, 57344.0),
        D.FP4: _Codec("float", ml_dtypes.float4_e2m1fn, 6.0),
    }


_CODECS: dict[DType, _Codec] = {  # the numpy ones; ml_dtypes' in `_ml_codecs`
    D.FLOAT64: _Codec("cast", np.float64),
    D.FLOAT32: _Codec("cast", np.float32),
    D.FLOAT16: _Codec("cast", np.float16),
    D.INT64: _Codec("sym", np.int64, 2.0**62),  # 2**62: exact in float64, cast cannot overflow
    D.INT32: _Codec("sym", np.int32, 2.0**31 - 1),
    D.INT16: _Codec("sym", np.int16, 32767.0),
    D.INT8: _Codec("sym", np.int8, 127.0),
    D.INT4: _Codec("sym", np.int8, 7.0),
    D.INT2: _Codec("sym", np.int8, 1.0),
    D.TERNARY: _Codec("sym", np.int8, 1.0),
    D.UINT64: _Codec("affine", np.uint64, 2.0**63),
    D.UINT32: _Codec("affine", np.uint32, 2.0**32 - 1),
    D.UINT16: _Codec("affine", np.uint16, 65535.0),
    D.UINT8: _Codec("affine", np.uint8, 255.0),
    D.UINT4: _Codec("affine", np.uint8, 15.0),
    D.UINT2: _Codec("affine", np.uint8, 3.0),
    D.BINARY: _Codec("sign", np.uint8),
}


def _scale_type(dt: DType) -> type:
    # 32/64-bit integer codes carry more precision than a float32 scale: keep those scales float64.
    return np.float64 if dt.bits >= 32 and not dt.is_float else np.float32


@dataclass(frozen=True, eq=False)
class Encoded:
    """An encoded 1-D or 2-D float array: codes (packed uint8 for sub-byte kinds) plus per-row params.

    2-D data has one scale (and zero point, for unsigned kinds) per row; 1-D data counts as one row.
    """

    dtype: DType
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray | None = None
    zero: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        extra = [a.nbytes for a in (self.scales, self.zero) if a is not None]
        return int(self.codes.nbytes + sum(extra))


def _row_absmax(rows: np.ndarray) -> np.ndarray:
    return np.max(np.abs(rows), axis=1, initial=0.0)  # [rows]


def _enc_cast(rows, dt, codec):
    with np.errstate(over="ignore"):  # out-of-range values become ±inf, as in the format
        return rows.astype(codec.store), None, None


def _enc_float(rows, dt, codec):
    scale = (_row_absmax(rows).astype(np.float64) / codec.qmax).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1.0))  # all-zero rows: codes 0, never NaN
    x = np.clip(rows / safe[:, None], -codec.qmax, codec.qmax)  # [rows, n] float32
    return x.astype(codec.store), scale, None


def _enc_sym(rows, dt, codec):
    st = _scale_type(dt)
    scale = (_row_absmax(rows).astype(np.float64) / codec.qmax).astype(st)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float64)
    x = np.rint(rows.astype(np.float64) / safe[:, None])  # [rows, n]
    return np.clip(x, -codec.qmax, codec.qmax).astype(codec.store), scale, None


def _enc_affine(rows, dt, codec):
    # code = rint((w - min) / scale), scale = (max - min) / qmax: uses the whole unsigned range.
    st = _scale_type(dt)
    n = rows.shape[1]
    lo = rows.min(axis=1) if n else np.zeros(rows.shape[0], np.float32)
    hi = rows.max(axis=1) if n else lo
    scale = ((hi.astype(np.float64) - lo) / codec.qmax).astype(st)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float64)
    x = np.rint((rows.astype(np.float64) - lo[:, None]) / safe[:, None])  # [rows, n]
    return np.clip(x, 0, codec.qmax).astype(codec.store), scale, lo.astype(st)


def _enc_sign(rows, dt, codec):
    n = max(rows.shape[1], 1)
    scale = (np.abs(rows).sum(axis=1, dtype=np.float64) / n).astype(np.float32)  # mean |w|
    return (rows >= 0).astype(np.uint8), scale, None


_ENCODERS = {
    "cast": _enc_cast,
    "float": _enc_float,
    "sym": _enc_sym,
    "affine": _enc_affine,
    "sign": _enc_sign,
}


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """[rows, n] small ints -> uint8 [rows, ceil(n*bits/8)]; element 0 in the highest bits."""
    per = 8 // bits
    u = codes.view(np.uint8) if codes.dtype.itemsize == 1 else codes.astype(np.uint8)
    u = u & np.uint8((1 << bits) - 1)
    pad = (-u.shape[1]) % per
    if pad:
        u = np.pad(u, ((0, 0), (0, pad)))
    shifts = (np.arange(per - 1, -1, -1) * bits).astype(np.uint8)
    groups = u.reshape(u.shape[0], -1, per)  # [rows, nbytes, per]
    return np.bitwise_or.reduce(groups << shifts, axis=2).astype(np.uint8)


def unpack_codes(packed: np.ndarray, bits: int, n: int, signed: bool) -> np.ndarray:
    """Inverse of `_pack`: uint8 [rows, nbytes] -> [rows, n] (int8 sign-extended, else uint8)."""
    per = 8 // bits
    shifts = (np.arange(per - 1, -1, -1) * bits).astype(np.uint8)
    u = (packed[:, :, None] >> shifts) & np.uint8((1 << bits) - 1)  # [rows, nbytes, per]
    u = u.reshape(packed.shape[0], packed.shape[1] * per)[:, :n]
    if not signed:
        return u
    half = np.int8(1 << (bits - 1))
    return (u.view(np.int8) ^ half) - half


def encode(values, dtype: DType | int | str) -> Encoded:
    """Encode float data (1-D, or 2-D with one scale per row) into `dtype`'s standard codes."""
    dt = parse_dtype(dtype)
    v = np.asarray(values, dtype=np.float32)
    if v.ndim not in (1, 2):
        raise DTypeError(f"encode takes 1-D or 2-D data, got shape {v.shape}")
    codec = _codec(dt)
    if codec.kind != "cast" and not np.isfinite(v).all():
        raise NumericalError(f"cannot encode non-finite values as {dt}")
    rows = v.reshape(1, -1) if v.ndim == 1 else v  # [rows, n]
    codes, scales, zero = _ENCODERS[codec.kind](rows, dt, codec)
    if dt.is_sub_byte:
        if dt is D.FP4:
            codes = codes.view(np.uint8)
        codes = _pack(codes, dt.bits)
    if v.ndim == 1:
        codes = codes[0]
    return Encoded(dt, tuple(v.shape), codes, scales, zero)


def encode_vector(values, dtype: DType | int | str) -> Encoded:
    """Encode 1-D data (a bias, a norm gamma) with one scale for the whole vector."""
    if np.ndim(values) != 1:
        raise DTypeError(f"encode_vector takes 1-D data, got shape {np.shape(values)}")
    return encode(values, dtype)


def _dec_codes(enc: Encoded, codes: np.ndarray, n: int) -> np.ndarray:
    """Unpacked codes [rows, n] of a row range (native dtype)."""
    dt = enc.dtype
    if not dt.is_sub_byte:
        return codes
    signed = dt.is_signed and dt is not D.FP4 and dt is not D.BINARY
    u = unpack_codes(codes, dt.bits, n, signed)
    return u.view(_codec(D.FP4).store) if dt is D.FP4 else u


def decode_rows(enc: Encoded, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Decode rows [start, stop) of an encoding as float32 [stop-start, n] (1-D data = one row)."""
    n = enc.shape[-1]
    nrows = enc.shape[0] if len(enc.shape) == 2 else 1
    stop = nrows if stop is None else stop
    if not 0 <= start <= stop <= nrows:
        raise DTypeError(f"row range [{start}, {stop}) outside 0..{nrows}")
    codes = enc.codes if len(enc.shape) == 2 else enc.codes[None]
    c = _dec_codes(enc, codes[start:stop], n)
    kind = _codec(enc.dtype).kind
    if kind == "cast":
        return c.astype(np.float32)
    scale = enc.scales[start:stop, None]
    if kind == "sign":
        return np.where(c.astype(bool), scale, -scale).astype(np.float32)
    work = scale.dtype  # float64 for the 32/64-bit integer kinds, else float32
    out = c.astype(work) * scale
    if kind == "affine":
        out += enc.zero[start:stop, None]
    return out.astype(np.float32, copy=False)


def decode(enc: Encoded) -> np.ndarray:
    """Decode an encoding back to float32 of the original shape."""
    return decode_rows(enc).reshape(enc.shape)


# --- Loom v1 parity (inventory §2.2-2.3, §4.4) -------------------------------------------------


def loom_nbytes(dtype: DType | int | str, count: int) -> int:
    """Byte length of a Loom native blob of `count` elements (sub-byte kinds padded to a byte)."""
    dt = parse_dtype(dtype)
    return -(-count * dt.bits // 8)

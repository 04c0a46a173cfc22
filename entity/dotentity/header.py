"""The `.entity` v2 header: the 20-byte prefix, the msgpack header schema and its validation.

Everything here works on bytes already read and on decoded records; `container` opens, maps
and writes the files (the byte layout is in its docstring and in docs/formats.md). The writer
decodes its own header with `decode_header` before writing it, so both sides share one schema.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, fields
from typing import Any

import msgpack
import numpy as np

# ISA-L's crc32: zlib's checksum, several times faster (round 2, session 35)
from isal.isal_zlib import crc32

from entity.dotentity.header_msgpack import (
    DEFERRED,
    MAX_BLOBS,
    peek,
    undefer,
    unpack,
)
from entity.dotentity.native_blocks import check_record
from entity.strict_json import (
    REQUIRED,
    Field,
    FieldError,
    check_fields,
    is_int,
    is_int_list,
    is_u32,
)
from poly.errors import EntityFormatError

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "ALIGN",
    "PREFIX",
    "BLOB_DTYPES",
    "BlobRecord",
    "META_KEYS",
    "CRC_TAIL",
    "Header",
    "align",
    "fail",
    "read_prefix",
    "decode_header",
    "check_layout",
    "peek_fields",
]

MAGIC = b"ENTITY\x00\x00"
FORMAT_VERSION = 2
ALIGN = 64  # cache-line and SIMD friendly; any page-aligned mmap keeps it
PREFIX = struct.Struct("<8sHHQ")  # magic, version, flags, header length
_CRC_KEY = "header_crc32"
CRC_TAIL = msgpack.packb(_CRC_KEY) + b"\xce"  # key, then uint32 marker, then 4 crc bytes


class _BlobDtypes(dict):
    """bfloat16 is resolved on first use: importing ml_dtypes costs every process ~0.2-0.8 s."""

    def __missing__(self, key: str) -> np.dtype:
        if key != "bfloat16":
            raise KeyError(key)
        import ml_dtypes

        value = self[key] = np.dtype(ml_dtypes.bfloat16)
        return value

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default


# Blob dtype names (the lower-case Loom names) -> numpy dtype, little-endian (and "bfloat16").
BLOB_DTYPES: dict[str, np.dtype] = _BlobDtypes(
    {
        "float64": np.dtype("<f8"),
        "float32": np.dtype("<f4"),
        "float16": np.dtype("<f2"),
        "int64": np.dtype("<i8"),
        "int32": np.dtype("<i4"),
        "int16": np.dtype("<i2"),
        "int8": np.dtype("i1"),
        "uint64": np.dtype("<u8"),
        "uint32": np.dtype("<u4"),
        "uint16": np.dtype("<u2"),
        "uint8": np.dtype("u1"),
    }
)


@dataclass(frozen=True, slots=True)
class BlobRecord:
    """One blob of a `.entity` file: where it lies, its dtype and shape, its crc32."""

    path: str
    offset: int
    length: int
    dtype: str
    shape: list[int]
    checksum: int
    # GGUF blocks kept native (entity.dotentity.native_blocks): uint8 [out, row_bytes]; absent
    # otherwise, so files without native blobs are byte-identical to those of older writers.
    ggml_type: int | None = None


@dataclass(frozen=True, slots=True)
class Header:
    """A `.entity` header, checked against `HEADER_FIELDS` (`decode_header`)."""

    format_version: int
    network: dict[str, Any] | bytes  # bytes: its msgpack map, deferred (`value`)
    transformer: dict[str, Any]
    quant: dict[str, Any]
    blobs: list[BlobRecord]
    tokenizer: str | bytes | None  # bytes: its UTF-8 text, deferred
    tokenizer_config: dict[str, Any]
    chat_template: str | None
    generation_config: dict[str, Any]
    eos_token_ids: list[int]
    source: dict[str, Any]
    header_crc32: int

    def value(self, key: str, path: str | None = None) -> Any:
        """Field `key` as stored: a deferred one (`decode_header`) decoded and checked now, as
        the rest of the header was at open."""
        value = getattr(self, key)
        if key not in DEFERRED or type(value) is not bytes:
            return value
        try:
            return undefer(key, value)
        except ValueError as exc:
            raise fail(str(exc), path, PREFIX.size) from None


# The schema as name tables (`entity.strict_json.Field`), checked by hand, not by pydantic,
# whose import every .entity open would pay. Unlike a config file, a header names no key outside
# its tables and a nil is a value (tested like any other).
def _string(low: int, high: int) -> Field:
    def test(v: Any) -> bool:
        return type(v) is str and low <= len(v) <= high

    return Field(test, f"a string of {low} to {high} characters", REQUIRED)


_NATURAL = Field(lambda v: is_int(v) and v >= 0, "an integer >= 0", REQUIRED)
_MAP = Field(lambda v: type(v) is dict, "a map", REQUIRED)
_U32 = Field(is_u32, "an integer in [0, 2**32)", REQUIRED)
_OPT_STR = Field(lambda v: v is None or type(v) is str, "a string or nil", REQUIRED)

BLOB_FIELDS: dict[str, Field] = {
    "path": _string(1, 512),
    "offset": _NATURAL,
    "length": _NATURAL,
    "dtype": Field(lambda v: type(v) is str, "a string", REQUIRED),
    "shape": Field(is_int_list, "a list of integers", REQUIRED),
    "checksum": _U32,
    "ggml_type": Field(lambda v: v is None or is_int(v), "an integer or nil"),  # may be left out
}
HEADER_FIELDS: dict[str, Field] = {
    "format_version": Field(lambda v: is_int(v) and v == 2, "2", REQUIRED),
    "network": _MAP,
    "transformer": _MAP,
    "quant": _MAP,
    "blobs": Field(
        lambda v: type(v) is list and len(v) <= MAX_BLOBS, f"a list of <= {MAX_BLOBS}", REQUIRED
    ),  # fmt: skip
    "tokenizer": _OPT_STR,
    "tokenizer_config": _MAP,
    "chat_template": _OPT_STR,
    "generation_config": _MAP,
    "eos_token_ids": Field(is_int_list, "a list of integers", REQUIRED),
    "source": _MAP,
    _CRC_KEY: _U32,
}


def _checked(obj: Any, table: dict[str, Field], where: str) -> dict[str, Any]:
    """`obj`'s fields, each what `table` says (ValueError naming the first that is not)."""
    if type(obj) is not dict:
        raise ValueError(f"bad header field {where.rstrip('.') or 'header'}: must be a map")
    try:
        return check_fields(table, obj, refuse_unknown=True, null_is_absent=False)
    except FieldError as exc:
        raise ValueError(f"bad header field {where}{exc}") from None


def _header_fields(obj: Any) -> dict[str, Any]:
    head = _checked(obj, HEADER_FIELDS, "")
    head["blobs"] = [
        BlobRecord(**_checked(b, BLOB_FIELDS, f"blobs.{i}.")) for i, b in enumerate(head["blobs"])
    ]
    return head


META_KEYS = tuple(
    f.name for f in fields(Header) if f.name not in ("format_version", "blobs", _CRC_KEY)
)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def fail(msg: str, path: str | None, offset: int | None = None) -> EntityFormatError:
    """The `EntityFormatError` of a damaged file (to raise)."""
    return EntityFormatError(msg, path=path, offset=offset)


def read_prefix(f, path: str | None = None) -> tuple[int, int, int]:
    """Read and check the 20-byte prefix: returns (version, flags, header length)."""
    raw = f.read(PREFIX.size)
    if len(raw) < PREFIX.size:
        raise fail("truncated: file shorter than the 20-byte prefix", path, 0)
    magic, version, flags, hlen = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise fail("not an .entity file (bad magic)", path, 0)
    return version, flags, hlen


def decode_header(raw: bytes, path: str | None, *, defer: bool = True) -> Header:
    """The checked header of `raw` (the bytes after the prefix). ``defer``: the tokenizer text
    and the network spec stay bytes (`DEFERRED`); the writer checks everything it writes."""
    later: dict[str, bytes] = {}
    try:
        obj = unpack(raw, later)
        if not defer:
            obj.update({key: undefer(key, data) for key, data in later.items()})
            later.clear()
        head = _header_fields({**obj, **{key: DEFERRED[key][1] for key in later}})
    except ValueError as exc:
        raise fail(str(exc), path, PREFIX.size) from exc
    return Header(**{**head, **later})


def peek_fields(raw: bytes, keys: tuple[str, ...], path: str | None) -> dict[str, Any]:
    """The values of top-level ``keys`` of a msgpack header map; every other value is skipped
    by msgpack without building it."""
    try:
        return peek(raw, keys)
    except ValueError as exc:
        raise fail(str(exc), path, PREFIX.size) from exc


def check_layout(blobs: list[BlobRecord], data_start: int, size: int, path: str | None) -> None:
    seen: set[str] = set()
    expect = data_start
    for b in sorted(blobs, key=lambda r: r.offset):
        if b.path in seen:
            raise fail(f"duplicate blob path {b.path!r}", path)
        seen.add(b.path)
        dt = BLOB_DTYPES.get(b.dtype)
        if dt is None:
            raise fail(f"blob {b.path!r}: unknown dtype {b.dtype!r}", path)
        if any(d < 0 for d in b.shape) or math.prod(b.shape) * dt.itemsize != b.length:
            raise fail(f"blob {b.path!r}: length {b.length} != shape {b.shape} x {b.dtype}", path)
        if b.ggml_type is not None:
            try:
                check_record(b.ggml_type, b.dtype, b.shape)
            except EntityFormatError as exc:
                raise fail(f"blob {b.path!r}: {exc.message}", path) from exc
        if b.offset != expect:
            raise fail(f"blob {b.path!r}: offset {b.offset}, expected {expect}", path, b.offset)
        expect = align(b.offset + b.length)
    end = max((b.offset + b.length for b in blobs), default=data_start)
    if end != size:
        what = "truncated" if end > size else "trailing bytes after the last blob"
        raise fail(f"{what}: data ends at {end}, file size {size}", path, min(end, size))


CRC_CHUNK = 16 << 20


def crc_of_range(f, start: int, length: int) -> int:
    """The crc32 of ``length`` bytes of ``f`` from ``start``, read through a small buffer."""
    f.seek(start)
    crc = 0
    buf = bytearray(min(CRC_CHUNK, max(length, 1)))
    view = memoryview(buf)
    left = length
    while left > 0:
        n = f.readinto(view[: min(left, len(buf))])
        if not n:
            raise fail("truncated while verifying", None, start + length - left)
        crc = crc32(view[:n], crc)
        left -= n
    return crc

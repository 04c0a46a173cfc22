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
MAX_BLOBS = 1 << 17  # a 671B MoE stored per expert has ~60k tensors
# Containers plus their elements, summed over the whole header: each costs ~100 bytes of Python
# objects, so this bounds decoding memory whatever the bytes are (64 MB of one-byte empty arrays
# was 4.6 GB). A blob record is ~12 items: the blob table at its cap fits.
MAX_HEADER_ITEMS = 16 * MAX_BLOBS
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
    network: dict[str, Any] | bytes  # bytes: its msgpack map, deferred (`network_spec`)
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
        return _undefer(key, value, path) if key in _DEFERRED and type(value) is bytes else value


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


class _ItemBudget:
    """Counts containers and elements as msgpack builds them; refuses past MAX_HEADER_ITEMS."""

    def __init__(self) -> None:
        self.items = 0

    def charge(self, n: int) -> None:
        self.items += n + 1
        if self.items > MAX_HEADER_ITEMS:
            raise ValueError(f"header holds more than {MAX_HEADER_ITEMS} values")

    def list_hook(self, value: list) -> list:
        self.charge(len(value))
        return value

    def pairs_hook(self, pairs: list[tuple[Any, Any]]) -> dict:
        self.charge(len(pairs))
        out = dict(pairs)  # the common case checked in C; `_no_dups` names what is wrong
        if len(out) != len(pairs) or not _STR_ONLY.issuperset(map(type, out)):
            return _no_dups(pairs)
        return out


_STR_ONLY = frozenset({str})


def _no_dups(pairs: list[tuple[Any, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if not isinstance(k, str):
            raise ValueError("header map key is not a string")
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} not allowed")


def _all_finite(obj: Any) -> bool:
    """No NaN or infinity anywhere in `obj` (a walk without paths: `_check_finite` names one)."""
    stack = [obj]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return False
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list:
            stack.extend(item)
    return True


def _check_finite(obj: Any, where: str = "header") -> None:
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"non-finite number at {where}")
    if isinstance(obj, dict):
        for k, v in obj.items():
            _check_finite(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _check_finite(v, f"{where}[{i}]")


def _describe(exc: Exception) -> str:
    """msgpack's StackError (nesting deeper than its limit) has an empty message."""
    if str(exc):
        return str(exc)
    if isinstance(exc, msgpack.exceptions.StackError):
        return "nesting too deep"
    return type(exc).__name__


# Values an open does not read, kept as bytes when they are of their expected kind (anything
# else is decoded and refused as usual): the tokenizer's UTF-8 text (hashed, not decoded, when a
# kept tokenizer matches it: `poly.text.tokenizer_cache`) and the network spec (Loom's grid).
# The schema checks them as these stand-ins of their kind.
_DEFERRED = {"tokenizer": ("str", ""), "network": ("map", {})}
_STR_LENGTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4}  # str8/16/32: big-endian length bytes after the marker


def _kind(first: int) -> str:
    if 0xA0 <= first <= 0xBF or first in _STR_LENGTHS:
        return "str"
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    return "other"


def _unpacker(raw: bytes) -> tuple[msgpack.Unpacker, _ItemBudget]:
    budget = _ItemBudget()
    up = msgpack.Unpacker(
        raw=False, strict_map_key=True, object_pairs_hook=budget.pairs_hook,
        list_hook=budget.list_hook, ext_hook=_reject_ext, max_buffer_size=len(raw) + 1,
        max_array_len=MAX_BLOBS, max_map_len=MAX_BLOBS,
    )  # fmt: skip
    up.feed(raw)
    return up, budget


def _top_map(up: msgpack.Unpacker, raw: bytes, later: dict[str, bytes]) -> dict[str, Any]:
    """The header map; `_DEFERRED` values of their kind go to `later` as bytes (a string's
    UTF-8 payload, a map's msgpack), skipped by msgpack without being built."""
    out: dict[str, Any] = {}
    for _ in range(up.read_map_header()):
        key = up.unpack()
        if type(key) is not str:
            raise ValueError("header map key is not a string")
        if key in out or key in later:
            raise ValueError(f"duplicate key {key!r}")
        start = up.tell()
        kind = _kind(raw[start]) if start < len(raw) else "other"
        if key in _DEFERRED and kind == _DEFERRED[key][0]:
            up.skip()
            head = 1 + _STR_LENGTHS.get(raw[start], 0) if kind == "str" else 0
            later[key] = raw[start + head : up.tell()]
        else:
            out[key] = up.unpack()
    return out


def _unpack(raw: bytes, path: str | None, later: dict[str, bytes] | None = None) -> Any:
    """One msgpack value under the header's limits (items, nesting, unique string keys, no ext
    types, finite numbers); given `later`, a map whose `_DEFERRED` values go there."""
    up, _ = _unpacker(raw)
    try:
        obj = _top_map(up, raw, later) if later is not None else up.unpack()
        if up.tell() != len(raw):
            raise ValueError("extra data after the value")
        # blob records hold no float that passes their type checks: their values are not walked
        rest = obj if later is None else [v for k, v in obj.items() if k != "blobs"]
        if not _all_finite(rest):
            _check_finite(obj)
    except Exception as exc:  # msgpack raises many kinds (ValueError, StackError, ExtraData...)
        raise fail(f"bad msgpack header: {_describe(exc)}", path, PREFIX.size) from exc
    return obj


def decode_header(raw: bytes, path: str | None, *, defer: bool = True) -> Header:
    """The checked header of `raw` (the bytes after the prefix). ``defer``: the tokenizer text
    and the network spec stay bytes (`_DEFERRED`); the writer checks everything it writes."""
    later: dict[str, bytes] = {}
    obj = _unpack(raw, path, later)
    if not defer:
        obj.update({key: _undefer(key, data, path) for key, data in later.items()})
        later.clear()
    try:
        head = _header_fields({**obj, **{key: _DEFERRED[key][1] for key in later}})
    except ValueError as exc:
        raise fail(str(exc), path, PREFIX.size) from None
    return Header(**{**head, **later})


def _undefer(key: str, data: bytes, path: str | None) -> Any:
    if _DEFERRED[key][0] == "map":
        return _unpack(data, path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"bad msgpack header: {exc}", path, PREFIX.size) from None


def peek_fields(raw: bytes, keys: tuple[str, ...], path: str | None) -> dict[str, Any]:
    """The values of top-level ``keys`` of a msgpack header map; every other value is skipped
    by msgpack without building it."""
    up, _ = _unpacker(raw)
    out: dict[str, Any] = {}
    try:
        for _ in range(up.read_map_header()):
            key = up.unpack()
            if key in keys and key not in out:
                out[key] = up.unpack()
            else:
                up.skip()
    except Exception as exc:  # msgpack raises many kinds
        raise fail(f"bad msgpack header: {_describe(exc)}", path, PREFIX.size) from exc
    return out


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

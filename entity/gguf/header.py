"""The byte-level half of the GGUF reader (`entity.gguf.reader`): the bounds every count, length
and string is checked against, a bounded Cursor over the file's bytes, and the readers of the
key/value pairs, tensor infos and alignment. A violation is a GGUFFormatError with its offset."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from poly.errors import GGUFFormatError, LimitExceededError
from poly.quant.ggml import QUANT_SIZES, GGMLType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4
MAX_TENSOR_NAME = 63  # ggml GGML_MAX_NAME is 64 bytes including the NUL
MAX_KEY_LEN = 65535  # GGUF spec
MAX_STRING = 1 << 20  # 1 MiB per ordinary string value
MAX_ARRAY_ELEMENTS = 1 << 30  # ggml's GGUF_MAX_ARRAY_ELEMENTS
# String arrays become Python lists (~60 bytes and a parse step per element): token lists and
# merges of real vocabularies (<= 262k) fit; 60 MB of empty strings was 7.4M elements, 47 s.
MAX_STRING_ARRAY = 1 << 21
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
HEADER_BYTES = 24  # magic, version u32, n_tensors u64, n_kv u64
# Strings allowed past MAX_STRING (still bounded by the file size).
LARGE_STRING_KEYS = ("tokenizer.chat_template",)
# Smallest possible encoding of one KV pair / one tensor info: used to bound the counts.
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8

# GGUF value type id -> (struct format, numpy dtype); STRING=8 and ARRAY=9 handled apart.
SCALAR_TYPES: dict[int, tuple[str, np.dtype]] = {
    0: ("<B", np.dtype("<u1")),
    1: ("<b", np.dtype("<i1")),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype("?")),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
T_UINT32, T_BOOL, T_STRING, T_ARRAY = 4, 7, 8, 9


@dataclass(frozen=True)
class StringArray:
    """A string array left unread by the parse (`read_kv`'s ``later`` keys), its lengths checked:
    its `count` strings start at `start`. `GGUFFile.strings` reads them when they are needed (a
    vocabulary and its merges are ~100k strings, which a tokenizer kept by an earlier open does
    not need)."""

    start: int
    count: int
    cap: int

    def __len__(self) -> int:
        return self.count


class Cursor:
    """Bounded little-endian reads over the mapped file."""

    def __init__(self, buf: np.ndarray, path: str):
        # a memoryview: slicing a memmap builds an array subclass per call (100k tokenizer
        # strings of a GGUF took ~1.5 s that way)
        self.buf = memoryview(buf).cast("B")
        self.pos = 0
        self.end = len(buf)
        self.path = path

    def fail(self, message: str, offset: int | None = None) -> GGUFFormatError:
        return GGUFFormatError(
            message, path=self.path, offset=self.pos if offset is None else offset
        )

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.remaining:
            raise self.fail(f"truncated file: {what} needs {n} bytes, {self.remaining} remain")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", what)

    def string(self, what: str, cap: int) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        if n > cap:
            raise self.fail(f"{what}: length {n} exceeds the limit {cap}", start)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what}: invalid UTF-8 ({exc.reason})") from None
        self.pos += n
        return text

    def strings(self, count: int, what: str, cap: int) -> list[str]:
        """`count` strings in a row: a vocabulary's ~50-150k, in one tight loop (string() per item
        took 0.37 s of a 1B GGUF's 0.85 s load); anything off goes through string(), which raises
        the error it would have."""
        fast = _native_strings(self.buf, self.pos, count, cap)
        if fast is not None:
            out, self.pos = fast
            return out
        buf, pos, end, out = self.buf, self.pos, self.end, []
        length = _U64.unpack_from
        for _ in range(count):
            if end - pos >= 8:
                (n,) = length(buf, pos)
                if n <= cap and n <= end - pos - 8:
                    try:
                        out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8"))
                        pos += 8 + n
                        continue
                    except UnicodeDecodeError:
                        pass
            self.pos = pos
            out.append(self.string(what, cap))  # raises: truncated, too long or not UTF-8
            pos = self.pos
        self.pos = pos
        return out


_U64 = struct.Struct("<Q")


def _native_strings(buf, pos: int, count: int, cap: int) -> tuple[list, int] | None:
    """The C reader (csrc/formats/gguf_strings.h) when it is built and every
    string is sound; else None, and the loop reads them (and names what is wrong)."""
    return _native("gguf_strings", buf, pos, count, cap) if count >= 64 else None


def _strings_end(buf, pos: int, count: int, cap: int) -> int | None:
    """Where `count` strings from `pos` end, their lengths checked (C); None where one is off or
    the extension is not built (then they are read, and the error names what is off)."""
    return _native("gguf_strings_end", buf, pos, count, cap)


def _native(name: str, *args: Any) -> Any:
    """The C extension's `name` called on `args`; None where the extension has no such call."""
    from poly.runtime.ckernels import EXT

    call = getattr(EXT, name, None)
    return None if call is None else call(*args)


def _read_value(cur: Cursor, vtype: int, key: str, later=()) -> tuple[Any, int | None]:
    """Returns (value, element type for arrays or None)."""
    if vtype in SCALAR_TYPES:
        value = cur.scalar(SCALAR_TYPES[vtype][0], key)
        return (int(value) if vtype != 6 and vtype != 12 and vtype != T_BOOL else value), None
    if vtype == T_STRING:
        cap = cur.remaining if key.startswith(LARGE_STRING_KEYS) else MAX_STRING
        return cur.string(f"value of {key!r}", cap), None
    if vtype == T_ARRAY:
        return _read_array(cur, key, later)
    raise cur.fail(f"unknown value type {vtype} for key {key!r}", cur.pos - 4)


def _read_array(cur: Cursor, key: str, later=()) -> tuple[Any, int]:
    start = cur.pos
    etype = cur.u32(f"array type of {key!r}")
    n = cur.u64(f"array length of {key!r}")
    if etype == T_ARRAY:
        raise cur.fail(f"nested array in {key!r}", start)
    if etype == T_STRING:
        min_size = 8  # each element carries at least its u64 length
    elif etype in SCALAR_TYPES:
        min_size = SCALAR_TYPES[etype][1].itemsize
    else:
        raise cur.fail(f"unknown array element type {etype} for key {key!r}", start)
    if n > MAX_ARRAY_ELEMENTS or n * min_size > cur.remaining:
        raise cur.fail(f"array {key!r}: {n} elements do not fit in the file", start)
    if etype == T_STRING:
        if n > MAX_STRING_ARRAY:
            raise LimitExceededError(
                f"array {key!r}: {n} strings (limit {MAX_STRING_ARRAY})", path=cur.path
            )
        cap = min(cur.remaining, MAX_STRING)
        end = _strings_end(cur.buf, cur.pos, n, cap) if key in later else None
        if end is not None:
            value, cur.pos = StringArray(cur.pos, n, cap), end
            return value, etype
        return cur.strings(n, f"element of {key!r}", cap), etype
    dtype = SCALAR_TYPES[etype][1]
    arr = np.frombuffer(cur.buf, dtype=dtype, count=n, offset=cur.pos).copy()
    cur.pos += n * dtype.itemsize
    return arr, etype


def read_kv(
    cur: Cursor, n_kv: int, later: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[str, tuple[int, int | None]]]:
    """The key/value pairs; the string arrays named in `later` stay unread (`StringArray`)."""
    metadata: dict[str, Any] = {}
    types: dict[str, tuple[int, int | None]] = {}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string("metadata key", MAX_KEY_LEN)
        if not key:
            raise cur.fail("empty metadata key", start)
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}", start)
        vtype = cur.u32(f"type of {key!r}")
        value, etype = _read_value(cur, vtype, key, later)
        metadata[key] = value
        types[key] = (vtype, etype)
    return metadata, types


def _ggml_type(cur: Cursor, raw: int, name: str, at: int) -> GGMLType:
    try:
        qtype = GGMLType(raw)
    except ValueError:
        raise cur.fail(f"tensor {name!r}: unknown ggml type {raw}", at) from None
    if qtype not in QUANT_SIZES:
        raise cur.fail(f"tensor {name!r}: ggml type {qtype.name} has no known size", at)
    return qtype


def read_tensor_info(cur: Cursor, file_size: int) -> tuple[str, tuple[int, ...], int, int, int]:
    start = cur.pos
    name = cur.string("tensor name", MAX_TENSOR_NAME)
    if not name:
        raise cur.fail("empty tensor name", start)
    n_dims = cur.u32(f"n_dims of {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r}: n_dims {n_dims} not in 1..{MAX_DIMS}", cur.pos - 4)
    cur.need(8 * n_dims, f"dims of {name!r}")
    dims = [cur.u64(f"dim of {name!r}") for _ in range(n_dims)]
    count = 1
    for d in dims:
        if d == 0:
            raise cur.fail(f"tensor {name!r}: zero dimension in {dims}", start)
        count *= d
        if count > file_size * 64:  # even 1-bit-ish types cannot pack this many values in the file
            raise cur.fail(f"tensor {name!r}: shape {dims} is larger than the file", start)
    at = cur.pos
    qtype = _ggml_type(cur, cur.u32(f"type of {name!r}"), name, at)
    block, size = QUANT_SIZES[qtype]
    if dims[0] % block:
        raise cur.fail(f"tensor {name!r}: row of {dims[0]} not a multiple of {block}", at)
    nbytes = count // block * size
    offset = cur.u64(f"offset of {name!r}")
    # GGUF lists dims fastest-first: [896, 151936] is a (151936, 896) numpy array.
    return name, tuple(reversed(dims)), int(qtype), offset, nbytes


def read_alignment(cur: Cursor, metadata: dict, types: dict) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    value = metadata["general.alignment"]
    if types["general.alignment"] != (T_UINT32, None):
        raise cur.fail("general.alignment must be a UINT32", 0)
    if value <= 0 or value & (value - 1) or value > MAX_ALIGNMENT:
        raise cur.fail(f"general.alignment {value} is not a power of two <= {MAX_ALIGNMENT}", 0)
    return value

"""A validating GGUF reader.

Every count, length, type tag, shape, offset and alignment is checked against the bytes that remain
in the file BEFORE anything is allocated or looped over (reliability.md A2). Any violation raises
``GGUFFormatError`` carrying the byte offset; no ``struct.error``/``UnicodeDecodeError``/
``MemoryError`` escapes. Tensor data are read-only views on the file's bytes read into memory of
our own (`poly.filesnapshot.FileSnapshot`: the file may change on disk while the model runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from entity.gguf.header import (
    HEADER_BYTES,
    MAGIC,
    MIN_KV_BYTES,
    MIN_TENSOR_INFO_BYTES,
    VERSIONS,
    Cursor,
    StringArray,
    read_alignment,
    read_kv,
    read_tensor_info,
)
from poly.errors import GGUFFormatError, ModelFileChangedError, ModelNotFoundError, UnsupportedError
from poly.filesnapshot import FileSnapshot
from poly.quant.ggml import QUANT_SIZES, GGMLType, dequantize_mxfp4


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: ``shape`` is the numpy shape (GGUF dims reversed), ``offset`` is absolute."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLType(self.ggml_type).name

    @property
    def block_size(self) -> int:
        return QUANT_SIZES[GGMLType(self.ggml_type)][0]

    @property
    def row_bytes(self) -> int:
        block, size = QUANT_SIZES[GGMLType(self.ggml_type)]
        return self.shape[-1] // block * size


class GGUFFile:
    """A parsed, validated GGUF file: ``metadata`` maps keys to Python values (numeric arrays
    as numpy arrays, string arrays as lists), ``tensors`` names to ``TensorInfo`` in file order."""

    def __init__(
        self, path: str | os.PathLike, *, weights: bool = True, lazy=None, later: tuple = ()
    ):
        """``weights=False``: header and tensor table only, the file mapped (never read in full).
        ``lazy``: a test on tensor names; those tensors stay mapped from the file (MoE experts
        paged by `poly.runtime.expert_cache`), the rest is read into memory of our own.
        ``later``: metadata keys of string arrays read only when `strings` asks for them (until
        then ``metadata`` holds a `StringArray`)."""
        self.path, self._later = str(path), later
        if lazy is not None and weights:
            self._lazy_open(lazy)
            return
        try:
            size = os.path.getsize(self.path)
        except OSError as exc:
            raise ModelNotFoundError(
                f"cannot open GGUF file: {exc.strerror}", path=self.path
            ) from None
        try:  # weights: our own copy, a file rewritten under a mapping kills the process (SIGBUS)
            if size >= HEADER_BYTES:
                self.snapshot = FileSnapshot(self.path, lazy=() if weights else ((0, size),))
                self._mm, size = self.snapshot.array(), self.snapshot.size
        except (OSError, ValueError) as exc:
            raise GGUFFormatError(f"cannot read file: {exc}", path=self.path, offset=0) from None
        if size < HEADER_BYTES:
            raise GGUFFormatError(
                f"file too small for a GGUF header ({size} bytes)", path=self.path, offset=0
            )
        self.file_size = size
        self._parse(Cursor(self._mm, self.path))

    def kv_bytes(self) -> memoryview:
        """The metadata section as stored (what names a tokenizer kept by `tokenizer_cache`)."""
        lo, hi = self.kv_span
        return memoryview(self._mm[lo:hi])

    def strings(self, key: str) -> list[str]:
        """The string array `key` (``metadata[key]``), read now where the parse left it for later."""
        value = self.metadata[key]
        if isinstance(value, StringArray):
            cur = Cursor(self._mm, self.path)
            cur.pos = value.start
            value = self.metadata[key] = cur.strings(value.count, f"element of {key!r}", value.cap)
        return value

    def _lazy_open(self, lazy) -> None:
        """Parse the header off a mapping of the whole file, then read it in but for the
        tensors `lazy` names (parsed again there: no value keeps the first mapping)."""
        head = GGUFFile(self.path, weights=False)
        ranges = tuple((t.offset, t.nbytes) for t in head.tensors.values() if lazy(t.name))
        try:
            self.snapshot = FileSnapshot(self.path, lazy=ranges)
        except (OSError, ValueError) as exc:
            raise GGUFFormatError(f"cannot read file: {exc}", path=self.path, offset=0) from None
        if self.snapshot.identity != head.snapshot.identity:
            raise ModelFileChangedError("the file changed as it was opened", path=self.path)
        self._mm, self.file_size = self.snapshot.array(), self.snapshot.size
        self._parse(Cursor(self._mm, self.path))

    def _parse(self, cur: Cursor) -> None:
        if bytes(self._mm[:4]) != MAGIC:
            raise cur.fail(f"bad magic {bytes(self._mm[:4])!r}, expected {MAGIC!r}", 0)
        cur.pos = 4
        self.version = cur.u32("version")
        if self.version not in VERSIONS:
            raise cur.fail(f"unsupported GGUF version {self.version}", 4)
        n_tensors = cur.u64("tensor count")
        n_kv = cur.u64("kv count")
        if n_kv * MIN_KV_BYTES > cur.remaining:
            raise cur.fail(f"kv count {n_kv} cannot fit in the file", 16)
        if n_tensors * MIN_TENSOR_INFO_BYTES > cur.remaining:
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the file", 8)
        kv_start = cur.pos
        self.metadata, self.metadata_types = read_kv(cur, n_kv, self._later)
        self.kv_span = (kv_start, cur.pos)  # the metadata's bytes (`kv_bytes`)
        self.alignment = read_alignment(cur, self.metadata, self.metadata_types)
        if n_tensors * MIN_TENSOR_INFO_BYTES > cur.remaining:
            raise cur.fail(f"tensor count {n_tensors} cannot fit in the file", 8)
        infos = []
        for _ in range(n_tensors):
            info_at = cur.pos
            infos.append((info_at, *read_tensor_info(cur, self.file_size)))
        pad = -cur.pos % self.alignment
        self.data_offset = cur.pos + pad
        if self.data_offset > self.file_size:
            raise cur.fail("data section starts past the end of the file", cur.pos)
        self.tensors = self._place(cur, infos)

    def _place(self, cur: Cursor, infos: list) -> dict[str, TensorInfo]:
        data_size = self.file_size - self.data_offset
        tensors: dict[str, TensorInfo] = {}
        for info_at, name, shape, qtype, rel, nbytes in infos:
            if name in tensors:
                raise cur.fail(f"duplicate tensor name {name!r}", info_at)
            if rel % self.alignment:
                raise cur.fail(
                    f"tensor {name!r}: offset {rel} not a multiple of {self.alignment}", info_at
                )
            if rel + nbytes > data_size:
                raise cur.fail(f"tensor {name!r}: data runs past the end of the file", info_at)
            tensors[name] = TensorInfo(name, shape, qtype, self.data_offset + rel, nbytes)
        prev_end, prev_name = self.data_offset, None
        for t in sorted(tensors.values(), key=lambda t: t.offset):
            if t.offset < prev_end:
                raise cur.fail(f"tensor {t.name!r} overlaps {prev_name!r}", t.offset)
            prev_end, prev_name = t.offset + t.nbytes, t.name
        return tensors

    # --- tensor access ---------------------------------------------------------------------

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFFormatError(f"no tensor named {name!r}", path=self.path) from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """Raw bytes of a tensor: a read-only uint8 view, shape ``(*rows, row_bytes)``."""
        t = self.info(name)
        flat = self._mm[t.offset : t.offset + t.nbytes]
        return flat.reshape(*t.shape[:-1], t.row_bytes)  # [*rows, row_bytes]

    def tensor_array(self, name: str) -> np.ndarray:
        """Typed read-only view for plain types (F32/F16/F64/I*); raw bytes for quantized ones."""
        t = self.info(name)
        dtype = PLAIN_DTYPES.get(t.ggml_type)
        if dtype is None:
            return self.tensor_bytes(name)
        return self._mm[t.offset : t.offset + t.nbytes].view(dtype).reshape(t.shape)

    def dequantize(self, name: str, rows: slice | None = None) -> np.ndarray:
        """float32 values of a tensor (optionally a range of its leading-axis rows)."""
        t = self.info(name)
        raw = self.tensor_bytes(name)
        if rows is not None:
            raw = raw[rows]
        return dequantize_rows(raw, t.ggml_type, t.shape[-1])

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, v{self.version}, {len(self.tensors)} tensors)"


PLAIN_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("<f2"),
    24: np.dtype("i1"),
    25: np.dtype("<i2"),
    26: np.dtype("<i4"),
    27: np.dtype("<i8"),
    28: np.dtype("<f8"),
}


def dequantize_rows(raw: np.ndarray, ggml_type: int, row_len: int) -> np.ndarray:
    """Dequantize raw rows ``[*rows, row_bytes]`` of one ggml type into float32 ``[*rows, row_len]``."""
    if ggml_type == GGMLType.MXFP4:  # GPT-OSS experts: poly's own numpy dequantization
        return dequantize_mxfp4(raw, row_len).reshape(*raw.shape[:-1], row_len)
    if ggml_type in (GGMLType.F32, GGMLType.F16):  # norms, biases: no gguf-py import
        flat = np.ascontiguousarray(raw).view(PLAIN_DTYPES[ggml_type]).astype(np.float32)
        return flat.reshape(*raw.shape[:-1], row_len)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(ggml_type)
    try:
        out = dequantize(np.ascontiguousarray(raw), qtype)
    except NotImplementedError:
        raise UnsupportedError(f"cannot dequantize ggml type {qtype.name}") from None
    out = np.asarray(out, dtype=np.float32)
    return out.reshape(*raw.shape[:-1], row_len)  # [*rows, row_len]


def open_gguf(path: str | os.PathLike, *, weights: bool = True, later: tuple = ()) -> GGUFFile:
    """Parse and validate a GGUF file (``weights=False``: its header and tensor table only;
    ``later``: see `GGUFFile`)."""
    return GGUFFile(Path(path), weights=weights, later=later)
